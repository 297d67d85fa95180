"""`import tensorlens` and `tl.watch` work with only torch and numpy: optional vendors are blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ["wandb", "mlflow", "tensorboard", "lightning", "pytorch_lightning", "matplotlib", "tensorboardX"]

SCRIPT = textwrap.dedent(
    f"""
    import sys, importlib.abc

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ImportError(f"blocked for the test: {{name}}")
            return None

    sys.meta_path.insert(0, Block())
    import torch
    import tensorlens as tl
    import tensorlens.integrations
    model = torch.nn.Linear(3, 2)
    with tl.watch(model, save_interval=1, out_dir=sys.argv[1]) as hook:
        model(torch.randn(2, 3)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    print([b.name for b in hook.backends], tl.open_run(hook.run_dir).steps())
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r})
    assert not loaded, loaded
    try:
        tl.Hook(out_dir=sys.argv[1] + "2", backends=["wandb"])
    except ImportError as err:
        print("hint:", err)
    """
)


def test_core_needs_no_optional_dependency(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "['local'] [0]" in proc.stdout
    assert "pip install 'tensorlens[wandb]'" in proc.stdout
