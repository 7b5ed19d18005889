"""`clustertrain plan`: what a layout costs per rank, at any world size, computed on this CPU.

fake.py builds and steps one rank under a fake process group and counts its bytes; cost.py models the step's
compute and communication; plan.py puts them together per pipeline stage; search.py ranks the layouts that fit;
auto.py is `parallel.strategy: auto`; target.py says what the plan is for (world, device); picture.py draws it.
"""
