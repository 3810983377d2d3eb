"""`pip install ubep` needs torch, numpy and numba only: the command line's packages (the
`cli` extra: rich, matplotlib, scipy, pyyaml) are imported by the commands that use them.

Each check runs in a fresh interpreter, so what this test process imported does not count.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

EXTRA = ("rich", "matplotlib", "scipy", "yaml")

#: makes the extra's packages unimportable in the child, as where it is not installed
BLOCK = textwrap.dedent(f"""
    import sys

    class _NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {EXTRA!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
""")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_import_ubep_imports_none_of_the_cli_extra():
    code = ("import sys, ubep\n"
            f"print(sorted(set({EXTRA!r}) & set(sys.modules)))")
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_dispatch_and_the_parser_run_without_the_extra():
    """With the extra unimportable: a one-rank Buffer dispatches and combines (Numba runs
    without SciPy and PyYAML), and the `ubep` parser builds with every command."""
    code = BLOCK + textwrap.dedent("""
        import os, tempfile
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        import ubep
        from ubep.cli import build_parser
        from ubep.testing import make_routing, make_tokens

        fd, path = tempfile.mkstemp(prefix="ubep-deps-")
        os.close(fd)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
        os.unlink(path)
        idx, w = make_routing(3, 2, 4, seed=1)
        x = make_tokens(0, 3, 64, torch.bfloat16, seed=2)
        with ubep.Buffer(num_experts=4, hidden=64, max_tokens_per_rank=3, max_top_k=2,
                         backend="torch") as buf:
            r = buf.dispatch(x, idx, w)
            y = buf.combine(r.recv_x, r.handle, weighted=False)
        assert r.recv_x.shape[0] == int((idx >= 0).sum())
        assert y.shape == x.shape
        build_parser()
        print("ok")
    """)
    proc = _python(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_command_without_the_extra_says_how_to_install_it():
    code = BLOCK + textwrap.dedent("""
        from ubep.cli import main

        main(["verify", "--blocks", "1", "--epochs", "1"])
    """)
    proc = _python(code)
    assert proc.returncode != 0
    assert "ubep verify: this command needs rich, part of ubep's `cli` extra" in proc.stderr
    assert "pip install 'ubep[cli]'" in proc.stderr
    assert "Traceback" not in proc.stderr
