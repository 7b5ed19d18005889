"""Rendered sbatch scripts (golden files per preset and launcher), quoting, presets, and the requeue decision."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from clustertrain.cli import main
from clustertrain.config.load import load_config
from clustertrain.errors import ConfigError
from clustertrain.launch.jobs import decide, job_start, read_chain, record
from clustertrain.launch.presets import builtin_presets, load_preset
from clustertrain.launch.slurm import job_spec, render_script, shell_value
from clustertrain.run_dir import RunDir

GOLDEN = Path(__file__).parent / "golden"
FIXED = ["slurm.python=/opt/venv/bin/python", "train.run_dir=/scratch/runs/llama", "slurm.account=abc123",
         "slurm.nodes=2", "slurm.time=02:00:00"]


def render(*overrides: str, preset: str = "generic") -> str:
    config = load_config(None, [f"slurm.preset={preset}", *FIXED, *overrides])
    return render_script(config, ["/work/project/configs/llama.yaml"], Path("/work/project"), "configs/llama.yaml")


@pytest.mark.parametrize("preset", ["frontier", "perlmutter", "generic", "h100", "a100"])
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_rendered_script_matches_golden_file(preset, launcher):
    script = render(f"slurm.launcher={launcher}", preset=preset)
    golden = GOLDEN / f"{preset}-{launcher}.sh"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text(), f"re-run with UPDATE_GOLDEN=1 if the change to {golden.name} is intended"
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_every_builtin_preset_is_golden_tested():
    assert builtin_presets() == ["a100", "frontier", "generic", "h100", "perlmutter"]
    for name in builtin_presets():
        assert load_preset(name).sources, f"preset {name} must say where its values come from"


def test_frontier_preset_carries_network_rocm_and_offline_settings():
    script = render(preset="frontier")
    for line in ("export NCCL_SOCKET_IFNAME=hsn0", "export GLOO_SOCKET_IFNAME=hsn0", "export NCCL_CROSS_NIC=1",
                 "export NCCL_NET_GDR_LEVEL=3", "export FI_CXI_ATS=0", "export HF_HUB_OFFLINE=1",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=8", "#SBATCH --signal=B:USR1@300"):
        assert line in script.splitlines(), line
    assert "MIOPEN_USER_DB_PATH=\"/tmp/" in script and "--gpus-per-task=1" in script


WEIRD = "it's a \"test\"; $(touch pwned) `id` & | > < ${HOME} \\ * ?"


def test_values_with_spaces_and_metacharacters_stay_literal(tmp_path):
    config = load_config(None, [*FIXED, f"slurm.job_name={WEIRD}"])
    config = config.updated(slurm={"env": {"WEIRD": WEIRD, "PLAIN": "a b", "REF": "${HOME}/x y"},
                                   "modules": ["cray-python/3.11 extra"], "sbatch": {"comment": WEIRD}})
    script = render_script(config, [str(tmp_path / "my config.yaml"), "--set=optim.lr=1e-3; rm -rf /"],
                           tmp_path, "x")
    exports = [line for line in script.splitlines() if line.startswith("export ")]
    shown = subprocess.run(
        ["bash", "-c", "\n".join(exports) + '\nprintf "%s\\n%s\\n%s" "$WEIRD" "$PLAIN" "$REF"'],
        capture_output=True, text=True, cwd=tmp_path, env={"HOME": "/home/me", "PATH": os.environ["PATH"]},
    )
    # ${NAME} is the one form that expands, by design; everything else arrives as written
    assert shown.stdout.split("\n") == [WEIRD.replace("${HOME}", "/home/me"), "a b", "/home/me/x y"]
    assert not (tmp_path / "pwned").exists()
    # the launch line passes each argument whole
    assert "'--set=optim.lr=1e-3; rm -rf /'" in script and f"'{tmp_path}/my config.yaml'" in script
    assert "module load 'cray-python/3.11 extra'" in script


def test_shell_value_expands_only_braced_references():
    assert shell_value("hsn0") == "hsn0"
    assert shell_value("/lustre/${USER}/x") == '"/lustre/${USER}/x"'
    assert shell_value("$USER $(id) ${HOME}") == "'$USER $(id) '\"${HOME}\""


@pytest.mark.parametrize("override, message", [
    ("slurm.env={HF_TOKEN: abc}", "looks like a secret"),
    ("slurm.preset=summit", "no built-in preset 'summit'"),
    ("slurm.preset=missing/preset.yaml", "does not exist"),
    ("slurm.time=5", "signal_before = 300 s must be shorter"),
    ("slurm.time=ten", "not a Slurm time"),
    ("slurm.launcher=mpirun", "slurm.launcher"),
    ("slurm.requeue=always", "slurm.requeue"),
    ('slurm.job_name="a\\nb"', "one line"),
    ('slurm.sbatch={"x\\n#SBATCH --wrap": 1}', "not an sbatch option name"),
    ("slurm.sbatch={'mail type': END}", "not an sbatch option name"),
])
def test_bad_slurm_settings_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        config = load_config(None, [override])
        job_spec(config.slurm)


@pytest.mark.parametrize(("override", "key"), [
    ('train.run_dir="/scratch/runs/x\\nscancel -u me"', "train.run_dir"),
    ('name="llama\\n#SBATCH --requeue"', "name"),
])
def test_a_line_break_never_reaches_the_job_script(override, key):
    with pytest.raises(ConfigError, match=f"^{key} = .* holds a line break"):
        render(override)
    argument = "--set=optim.lr=1e-3\n#SBATCH --time=99:00:00"
    with pytest.raises(ConfigError, match="^an argument of clustertrain train = .* holds a line break"):
        render_script(load_config(None, FIXED), [argument], Path("/work/project"), "configs/llama.yaml")


@pytest.mark.parametrize(("override", "message"), [
    ("slurm.nodes=1000000000", "config error: slurm.nodes = 1000000000: Input should be less than or equal to 100000"),
    ("slurm.job_name=" + "x" * 120_000, "config error: slurm.job_name: 120,000 characters; at most 200"),
    ('slurm.job_name="run\\x1b[2J\\x07"', "config error: slurm.job_name: holds the control character "
                                          "'\\x1b'; use printable characters only"),
    ("name=" + "x" * 120_000, "name: 120,000 characters is too long for a Slurm job name (at most 200); set "
                              "slurm.job_name, or a shorter name"),
    ('name="run\\x07"', "name holds the control character '\\x07'; use printable characters only"),
    ("slurm.tasks_per_node=1000000000", "config error: slurm.tasks_per_node = 1000000000: Input should be less than "
                                        "or equal to 1024"),
    ("slurm.python=python -c 'import os; os.system(\"touch MARKER\")'", "config error: slurm.python = 'python -c "
     "\\'import os; os.system(\"touch MARKER\")\\'' cannot be a python command: give its path or name (letters, "
     "digits and . _ - + / @), e.g. /opt/venv/bin/python; set arguments elsewhere"),
], ids=["1e9-nodes", "long-job-name", "job-name-control-bytes", "long-run-name", "run-name-control-bytes",
        "1e9-tasks-per-node", "python-with-code"])
def test_slurm_render_refuses_absurd_values_in_one_short_line(override, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", "render", "--set", override, "-o", "job.sh"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"  # the key and its limit; not the 120,000 characters
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target", ["config", "preset"])
def test_render_output_never_replaces_the_config_or_preset(target, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("slurm:\n  preset: mine.yaml\n")
    (tmp_path / "mine.yaml").write_text("description: ours\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    out = {"config": "run.yaml", "preset": "./mine.yaml"}[target]
    assert main(["slurm", "render", "run.yaml", "--output", out, "--force"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --output {out}: that is the input")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_render_output_replaces_an_existing_file_only_with_force(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.sh").write_text("my own script\n")
    assert main(["slurm", "render", "-o", "job.sh"]) == 2
    assert capsys.readouterr().err == "error: --output job.sh exists; give another file, or --force to replace it\n"
    assert (tmp_path / "job.sh").read_text() == "my own script\n"
    assert main(["slurm", "render", "-o", "job.sh", "--force"]) == 0
    assert (tmp_path / "job.sh").read_text().startswith("#!/bin/bash")


def test_a_users_preset_file(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "description: our lab cluster\nsources: [wiki]\ngpus_per_node: 4\ncpus_per_task: 16\npartition: gpu\n"
        "modules: [cuda/12.4]\nenv: {NCCL_SOCKET_IFNAME: ib0}\nscratch: /scratch/${USER}\n"
    )
    config = load_config(None, [f"slurm.preset={tmp_path / 'mine.yaml'}", "slurm.env={NCCL_DEBUG: WARN}"])
    spec = job_spec(config.slurm)
    assert (spec.gpus_per_node, spec.tasks_per_node, spec.cpus_per_task, spec.partition) == (4, 4, 16, "gpu")
    assert spec.env["NCCL_SOCKET_IFNAME"] == "ib0" and spec.env["NCCL_DEBUG"] == "WARN"
    assert spec.env["HF_HOME"] == "/scratch/${USER}/huggingface"
    (tmp_path / "bad.yaml").write_text("gpus_per_node: lots\n")
    with pytest.raises(ConfigError, match="bad.yaml: gpus_per_node"):
        load_preset(str(tmp_path / "bad.yaml"))


def status(state, job="7", restart=0, **fields):
    return {"state": state, "slurm_job_id": job, "slurm_restart": restart, "step": 40, **fields}


@pytest.mark.parametrize("run_status, exit_code, signalled, restarts, on_stop, outcome", [
    (status("finished"), 0, False, 0, "requeue", "finished"),
    (status("preempted", reason="SIGUSR1"), 75, True, 0, "requeue", "requeue"),
    (status("preempted", reason="SIGUSR1"), 1, True, 0, "requeue", "requeue"),  # torchrun reports 1
    (status("preempted"), 75, False, 3, "requeue", "gave-up"),
    (status("preempted"), 75, False, 0, "none", "stopped"),
    (status("preempted"), 75, False, 0, "dependency", "requeue"),
    (status("running"), 138, True, 0, "requeue", "requeue"),  # warned before the ranks listened
    (status("failed", error="DataError: x"), 2, True, 0, "requeue", "failed"),
    (status("failed", error="DataError: x"), 2, False, 0, "requeue", "failed"),
    (status("running"), 1, False, 0, "requeue", "failed"),  # a crash
    (status("preempted", job="6"), 1, False, 0, "requeue", "failed"),  # an older job's status
    (status("finished", restart=1), 1, False, 0, "requeue", "failed"),  # the previous attempt's
    (None, 137, False, 0, "requeue", "failed"),
    (status("stopped"), 0, False, 0, "requeue", "stopped"),  # train.stop_after_steps: done as asked
])
def test_requeue_decision(run_status, exit_code, signalled, restarts, on_stop, outcome):
    assert decide(run_status, exit_code, signalled, "7", 0, restarts, 3, on_stop).outcome == outcome


def test_job_start_counts_restarts_of_the_submission_and_stops_a_loop(tmp_path, capsys):
    record(RunDir(tmp_path), "submitted", job_id="7")
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1"}
    assert job_start(RunDir(tmp_path), max_restarts=1, env=env) == 0
    assert job_start(RunDir(tmp_path), max_restarts=1, env={**env, "SLURM_RESTART_COUNT": "1"}) == 0
    assert job_start(RunDir(tmp_path), max_restarts=1, env={**env, "SLURM_RESTART_COUNT": "2"}) == 1
    assert "restarted 2 times (slurm.max_restarts = 1)" in capsys.readouterr().out
    assert [e["event"] for e in read_chain(RunDir(tmp_path))] == ["submitted", "started", "started", "started", "ended"]
    record(RunDir(tmp_path), "submitted", job_id="9")  # a new submission starts counting again
    assert job_start(RunDir(tmp_path), max_restarts=1, env={**env, "SLURM_JOB_ID": "9"}) == 0


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o027, 0o750), (0o077, 0o700)])
def test_the_job_script_and_config_copy_are_as_readable_as_the_umask_says(tmp_path, monkeypatch, umask, mode):
    from clustertrain.launch.jobs import submit

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 4242\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    config = load_config(None, [f"train.run_dir={tmp_path / 'run'}"])
    previous = os.umask(umask)
    try:
        job, script = submit(config, tmp_path, "configs/x.yaml")
    finally:
        os.umask(previous)
    assert job == "4242"
    assert script.stat().st_mode & 0o777 == mode
    assert (script.parent / "config.yaml").stat().st_mode & 0o777 == mode & 0o666


def environment_of_ranks(script: str, cpus_on_node: int) -> tuple[str, str]:
    """Run the script's lines before the training (no Slurm needed) on a node with `cpus_on_node` CPUs; returns
    (OMP_NUM_THREADS, the srun line with $cpus_per_task expanded)."""
    head = script.split("\npython=")[0]
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    shown = head + '\necho "$OMP_NUM_THREADS"\necho ' + srun.removesuffix("\\")  # bash expands the srun line
    result = subprocess.run(["bash", "-c", shown], capture_output=True, text=True, check=True,
                            env={"PATH": os.environ["PATH"], "SLURM_CPUS_ON_NODE": str(cpus_on_node)})
    threads, srun_line = result.stdout.splitlines()
    return threads, srun_line


@pytest.mark.parametrize(("launcher", "srun_cpus"), [("srun", "--cpus-per-task=8"), ("torchrun", "--cpus-per-task=32")])
def test_cpu_ranks_get_the_nodes_cores_counted_at_run_time(launcher, srun_cpus):
    script = render("slurm.tasks_per_node=4", f"slurm.launcher={launcher}")
    lines = script.splitlines()
    assert "#SBATCH --exclusive" in lines  # the whole node, so that Slurm's count is of every core
    assert not [line for line in lines if line.startswith("#SBATCH --cpus-per-task")]
    threads, srun = environment_of_ranks(script, 32)
    assert threads == "8" and srun_cpus in srun.split()
    assert environment_of_ranks(script, 3)[0] == "1"  # never 0 threads, on a node with fewer cores than ranks


def test_cpu_ranks_share_a_known_core_count_without_taking_whole_nodes(tmp_path):
    (tmp_path / "cpu.yaml").write_text("description: a CPU cluster\nsources: [wiki]\ncores_per_node: 56\n")
    script = render("slurm.tasks_per_node=2", preset=str(tmp_path / "cpu.yaml"))
    lines = script.splitlines()
    assert "#SBATCH --cpus-per-task=28" in lines and "export OMP_NUM_THREADS=28" in lines
    assert "#SBATCH --exclusive" not in lines and "cpus_per_task=" not in script
    assert any(line.startswith("srun --ntasks-per-node=2 --cpus-per-task=28 ") for line in lines)

    pinned = render("slurm.tasks_per_node=2", "slurm.cpus_per_task=6").splitlines()  # the config's own count
    assert "#SBATCH --cpus-per-task=6" in pinned and "export OMP_NUM_THREADS=6" in pinned
    assert "#SBATCH --exclusive" not in pinned


def test_gpu_ranks_keep_their_per_gpu_cpu_binding():
    frontier = render(preset="frontier").splitlines()
    assert "#SBATCH --cpus-per-task=7" in frontier and "export OMP_NUM_THREADS=7" in frontier
    generic_gpus = render("slurm.gpus_per_node=4").splitlines()
    assert "#SBATCH --cpus-per-task=1" in generic_gpus and "#SBATCH --exclusive" not in generic_gpus


def test_gpu_jobs_get_the_expandable_allocator_and_nccls_flight_recorder():
    gpu_env = ("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "export TORCH_NCCL_TRACE_BUFFER_SIZE=2000",
               "export TORCH_NCCL_DUMP_ON_TIMEOUT=1")
    for script in (render(preset="frontier"), render(preset="perlmutter"), render("slurm.gpus_per_node=4")):
        assert set(gpu_env) <= set(script.splitlines())
    assert not set(gpu_env) & set(render().splitlines()), "CPU jobs have no CUDA allocator or NCCL"
    own = render("slurm.env={PYTORCH_CUDA_ALLOC_CONF: 'max_split_size_mb:512'}", preset="frontier")
    assert "export PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512" in own.splitlines(), "the config's own value wins"
