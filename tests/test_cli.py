"""The kdtree-jax command line: generation with the embedded model, stats line, clear errors."""

import pytest

from kdtree_jax.cli import main, parse_mesh


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_generate_prints_text_and_stats(method, capsys):
    assert main(["generate", "--prompt", "import os\n", "--max-new-tokens", "24", "--method", method,
                 "--budget", "16"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("import os\n") and len(out.out) > len("import os\n")
    stats = out.out.strip().splitlines()[-1]
    assert stats.startswith("[stats]") and f"method={method}" in stats and "tau=" in stats
    assert "embedded model" in out.err


def test_bad_arguments_are_clear_errors(capsys):
    assert main(["generate", "--prompt", "x", "--max-new-tokens", "0"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--method", "ddtree", "--budget", "0"]) == 2
    assert "budget" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dp=N, ep=N, tp=N"):
        parse_mesh("tp=2,xx=3")
    assert parse_mesh("ep=4,tp=2") == {"ep": 4, "tp": 2}
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--budget" in capsys.readouterr().out
