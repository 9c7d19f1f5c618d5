"""The astrai-hf command's argument handling (the commands themselves are run in other tests)."""

import pytest

import astrai_hf.models
from astrai_hf.cli import main


class _Loaded(Exception):
    pass


@pytest.mark.parametrize("argv", [
    ["--model", "some/folder", "bench", "--suite", "decode"],
    ["bench", "--model", "some/folder", "--suite", "decode"],
    ["generate", "hello", "--model", "some/folder"],
    ["demo", "--model", "some/folder"],
])
def test_model_is_taken_before_or_after_the_subcommand(argv, monkeypatch):
    def load_model(path=None):
        raise _Loaded(path)

    monkeypatch.setattr(astrai_hf.models, "load_model", load_model)
    with pytest.raises(_Loaded) as e:
        main(argv)
    assert e.value.args == ("some/folder",)


def test_without_model_the_embedded_one_is_loaded(monkeypatch):
    def load_model(path=None):
        raise _Loaded(path)

    monkeypatch.setattr(astrai_hf.models, "load_model", load_model)
    with pytest.raises(_Loaded) as e:
        main(["demo"])
    assert e.value.args == (None,)


def test_a_missing_model_folder_is_one_line(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    assert main(["generate", "hi", "--model", missing]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"astrai-hf: cannot load the model: model folder {missing!r} does not exist"


@pytest.mark.parametrize("value", ["0", "-2"])
def test_bench_repeats_below_one_is_refused_naming_the_value(value, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--suite", "prefill", "--repeats", value])
    assert f"must be at least 1, got {value}" in capsys.readouterr().err
