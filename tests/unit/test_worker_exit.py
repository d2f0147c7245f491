"""A worker ends through run_and_exit: the code its main asks for, the program's own exit
handlers and threads finished first, its process group destroyed, then os._exit (which skips
the interpreter teardown where gloo's threads could abort a finished job)."""

import re
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import atexit, concurrent.futures, os, sys, threading, time
    from pathlib import Path
    import torch.distributed as dist
    from polytrain.train.worker_exit import run_and_exit

    out = Path(sys.argv[1])
    how = sys.argv[2]

    def main():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        atexit.register(lambda: (out / "atexit").write_text(str(dist.is_initialized())))
        threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("done"))).start()
        pool = concurrent.futures.ThreadPoolExecutor(2)  # idle non-daemon workers: told to stop at exit
        pool.submit(lambda: None).result()
        print("partial line without a newline", end="")
        if how == "exit":
            sys.exit(3)
        if how == "raise":
            raise RuntimeError("boom")
        return 0

    run_and_exit(main)
""")


def _run(tmp_path, how):
    return subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path), how],
                          capture_output=True, text=True, timeout=120)


def test_returns_mains_code_after_threads_atexit_and_flush(tmp_path):
    proc = _run(tmp_path, "return")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "partial line without a newline"  # flushed before os._exit
    assert (tmp_path / "thread").read_text() == "done"  # a non-daemon thread was waited for
    # atexit handlers ran while the process group was still there (it is destroyed after them)
    assert (tmp_path / "atexit").read_text() == "True"


def test_sys_exit_and_an_uncaught_error_keep_their_meaning(tmp_path):
    proc = _run(tmp_path, "exit")
    assert proc.returncode == 3, proc.stderr
    assert (tmp_path / "atexit").is_file()
    proc = _run(tmp_path, "raise")
    assert proc.returncode == 1
    assert "RuntimeError: boom" in proc.stderr and "Traceback" in proc.stderr


LEAVES_GROUP_LIVE = textwrap.dedent("""
    import atexit, os, sys
    from pathlib import Path
    import torch.distributed as dist
    from polytrain.backend import get_accelerator
    from polytrain.distributed.world import init_world

    out = Path(sys.argv[1]) / f"rank{os.environ['RANK']}"
    # Registered first, so it runs last: after polytrain's own exit handler.
    atexit.register(lambda: out.write_text(str(dist.is_initialized())))
    init_world(get_accelerator())
    if sys.argv[2] == "raise":
        raise RuntimeError("boom")
    if sys.argv[2] in ("worker error", "worker success"):  # through a worker's own exit path
        from polytrain.errors import PolytrainError
        from polytrain.train.worker_exit import run_and_exit, run_rank

        def work():
            if sys.argv[2] == "worker error":
                raise PolytrainError("bad input")
            return ["done"]
        run_and_exit(lambda: run_rank(work))
""")


def test_a_group_polytrain_made_is_destroyed_at_exit_unless_the_program_is_failing(tmp_path):
    script = tmp_path / "leave_live.py"
    script.write_text(LEAVES_GROUP_LIVE)
    cases = (("return", True), ("raise", False), ("worker success", True), ("worker error", False))
    for how, destroyed in cases:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node", "2", str(script), str(tmp_path), how],
                              capture_output=True, text=True, timeout=120)
        assert (proc.returncode == 0) == destroyed, proc.stderr[-2000:]
        # A failing program keeps its group: destroying under a peer mid-collective could hang.
        # run_rank / run_and_exit follow the same rule as the exit handler.
        assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [str(not destroyed)] * 2


PRINTS_AT_ONCE = textwrap.dedent("""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()  # both ranks print at the same moment
    for i in range(3000):
        print(f"rank {dist.get_rank()} line {i} " + "x" * 40)
    dist.destroy_process_group()
""")


def test_two_launched_ranks_printing_at_once_keep_their_lines_whole(tmp_path):
    """Launched workers run `python -u`; run_and_exit buffers each line into one write, so lines
    from ranks sharing a pipe never interleave mid-line (which `print` alone allows there)."""
    script = tmp_path / "prints.py"
    script.write_text(PRINTS_AT_ONCE)
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "run", "--nproc", "2", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank")]
    broken = [line for line in lines if not re.fullmatch(r"rank [01] line \d+ x{40}", line)]
    assert not broken, broken[:3]
    assert len(lines) == 6000
