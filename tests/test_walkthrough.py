"""docs/WRITING_A_TASK.md runs as written: its CUDA block is the body file, its Python block the script
(on a CPU: compile, verify, emulate and the check against torch)."""
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "WRITING_A_TASK.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def test_the_walkthrough_runs(tmp_path, monkeypatch, capsys):
    (cuda,), (script,) = _blocks("cuda"), _blocks("python")
    (tmp_path / "scale_bias.cuh").write_text(cuda)
    monkeypatch.chdir(tmp_path)
    exec(compile(script, str(DOC), "exec"), {"__name__": "walkthrough"})
    assert "scale_bias: PtxasReport" in capsys.readouterr().out
