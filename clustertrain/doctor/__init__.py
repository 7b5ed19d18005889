"""`clustertrain doctor`: before a long run, every rank checks what the run will need and measures its device and
links, so that a bad node or a missing file fails in a minute with one line, not hours into the job.

    checks.py   one rank alone: the preset's environment, the RCCL plugin, MIOpen's cache, HF offline, the model
                snapshot, tokenizer and data, disk for the checkpoints
    measure.py  a matmul, ping-pongs with the ring neighbours, each mesh dimension's collectives
    report.py   every rank's record -> one verdict: the table, one line per failure, the bad hosts
    run.py      one rank's whole path, launched like `clustertrain train`
"""
