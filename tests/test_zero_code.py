"""Zero-code patching (``astrai-hf run``) and the ``patched(model)`` context manager."""

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import astrai_hf
import astrai_hf.patches.autopatch as autopatch
from astrai_hf.cli import main
from tiny_models import left_padded_batch, tiny_model

SCRIPT = textwrap.dedent(
    """
    # a user's script: it never imports astrai-hf
    import sys
    sys.path.insert(0, {tests!r})
    from tiny_models import left_padded_batch, tiny_model
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9, 17], seed=1)
    for _ in range(2):
        print(model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6).tolist())
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "user_script.py"
    path.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    return path


def test_run_routes_an_unmodified_script_through_the_pool(script, capsys):
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert main(["run", "--report", "--page-size", "4", "--max-reqs", "3", str(script)]) == 0  # (3 rows: fits)
    out, err = capsys.readouterr()
    assert out == done.stdout  # the same tokens
    (report,) = [line for line in err.splitlines() if line.startswith("astrai-hf: LlamaForCausalLM {")]
    stats = json.loads(report.split(" ", 2)[2])  # the pool's stats when the script ended
    assert (stats["page_size"], stats["max_reqs"], stats["num_used_pages"]) == (4, 3, 0)
    assert stats["prefix_query_tokens"] == 2 * (5 + 9 + 17) and stats["prefix_hit_tokens"] > 0
    from transformers.generation.utils import GenerationMixin

    assert "autopatch" not in GenerationMixin.generate.__code__.co_filename  # uninstalled after the run
    for model in autopatch.patched_models():  # (the script's namespace is gone: nothing holds its model now)
        astrai_hf.unpatch(model)


def test_run_command_in_a_fresh_process(script):
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    done = subprocess.run([sys.executable, "-m", "astrai_hf", "run", "--report", str(script)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == plain.stdout
    report = [line for line in done.stderr.splitlines() if line.startswith("astrai-hf: LlamaForCausalLM")]
    stats = json.loads(report[0].split(" ", 2)[2])
    assert stats["prefix_query_tokens"] > 0 and stats["num_used_pages"] == 0
    assert any(line.startswith("astrai-hf patched LlamaForCausalLM: PagePool(") for line in done.stderr.splitlines())
    quiet = subprocess.run([sys.executable, "-m", "astrai_hf", "run", "--quiet", str(script)], capture_output=True,
                           text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stdout == plain.stdout, quiet.stderr
    assert "astrai-hf patched" not in quiet.stderr


def test_autopatch_leaves_unpatchable_models_alone(caplog):
    model = tiny_model("falcon", new_decoder_architecture=False, multi_query=False, num_kv_heads=4, alibi=True)
    ids, mask = left_padded_batch([4, 6], seed=2)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
    autopatch.install()
    try:
        with caplog.at_level("WARNING", logger="astrai_hf"):
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
    finally:
        autopatch.uninstall()
    assert torch.equal(out, ref) and not astrai_hf.is_patched(model)
    assert "left FalconForCausalLM unpatched" in caplog.text
    # seen once: a second call neither tries nor warns again, and the model is among those the hook has seen
    assert caplog.text.count("left FalconForCausalLM unpatched") == 1
    assert any(m is model for m in autopatch.patched_models())


def test_settings_from_env():
    env = {"ASTRAI_HF_MAX_TOKENS": "4096", "ASTRAI_HF_PAGE_SIZE": "8", "ASTRAI_HF_MAX_REQS": "256",
           "ASTRAI_HF_PREFIX_CACHE": "0"}
    assert autopatch.settings_from_env(env) == {"max_tokens": 4096, "page_size": 8, "max_reqs": 256,
                                                "prefix_cache": False}
    for name in ("ASTRAI_HF_PAGE_SIZE", "ASTRAI_HF_MAX_REQS"):
        with pytest.raises(ValueError, match=f"{name}='big' is not an integer"):
            autopatch.settings_from_env({name: "big"})
    # only "0" had turned the prefix cache off; "false" left it on without a word
    for off in ("false", "No", "off", " 0 "):
        assert autopatch.settings_from_env({"ASTRAI_HF_PREFIX_CACHE": off}) == {"prefix_cache": False}
    for on in ("1", "true", "yes", ""):
        assert autopatch.settings_from_env({"ASTRAI_HF_PREFIX_CACHE": on}) == {}
    # set but empty (`export ASTRAI_HF_MAX_TOKENS=`): unset, as for the prefix cache
    assert autopatch.settings_from_env({f"ASTRAI_HF_{n}": "" for n in ("MAX_TOKENS", "PAGE_SIZE", "MAX_REQS")}) == {}
    with pytest.raises(ValueError, match="ASTRAI_HF_PREFIX_CACHE='maybe'"):
        autopatch.settings_from_env({"ASTRAI_HF_PREFIX_CACHE": "maybe"})


def test_autopatch_checks_its_sizes_up_front_and_never_falls_back_to_stock_after_an_error(monkeypatch):
    for name in ("ASTRAI_HF_MAX_TOKENS", "ASTRAI_HF_PAGE_SIZE", "ASTRAI_HF_MAX_REQS"):  # (`astrai-hf run` sets them)
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        autopatch.install(page_size=0)
    for sizes in (dict(max_tokens=8, page_size=16), dict(max_tokens=10)):  # (had raised in the script, at generate())
        with pytest.raises(ValueError, match=r"max_tokens=(8|10) is smaller than one page \(page_size=16\)"):
            autopatch.install(**sizes)
    for name in ("max_seq_len", "max_reqs"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int, got 0"):
            autopatch.install(**{name: 0})
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 6], seed=2)

    def refused(*args, **kwargs):  # a pool that cannot be built for this model (its sizes, its memory)
        raise ValueError("no pool for this model")

    autopatch.install(max_tokens=64)
    monkeypatch.setattr(astrai_hf.PagePool, "from_model", refused)
    try:
        for _ in range(2):  # the second call had run stock generate(), unpatched, without a word
            with pytest.raises(ValueError, match="no pool for this model"):
                model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
        assert not astrai_hf.is_patched(model)
    finally:
        autopatch.uninstall()


def test_install_is_idempotent_and_its_arguments_win_over_the_environment(monkeypatch):
    from transformers.generation.utils import GenerationMixin

    stock = GenerationMixin.generate
    monkeypatch.setenv("ASTRAI_HF_PAGE_SIZE", "8")
    monkeypatch.setenv("ASTRAI_HF_MAX_TOKENS", "256")
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 6], seed=2)
    autopatch.install(page_size=4)
    autopatch.install()  # a second install keeps the first one's hook and settings
    try:
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)
        pool = astrai_hf.get_pool(model)
        assert (pool.page_size, pool.stats()["num_pages"]) == (4, 256 // 4)
    finally:
        autopatch.uninstall()
        astrai_hf.unpatch(model)
    assert GenerationMixin.generate is stock  # one uninstall takes the hook off


def test_run_gives_the_script_its_own_folder_on_sys_path_and_refuses_a_missing_one(tmp_path, capsys):
    (tmp_path / "helper_mod.py").write_text("VALUE = 41\n")
    script = tmp_path / "uses_helper.py"
    script.write_text("import helper_mod\nprint(helper_mod.VALUE + 1)\n")
    before = list(sys.path)
    assert main(["run", "--quiet", str(script)]) == 0
    assert capsys.readouterr().out == "42\n" and sys.path == before
    folder = tmp_path / "app"  # a folder with a __main__.py runs as `python app` runs it
    folder.mkdir()
    (folder / "__main__.py").write_text("print('from the folder')\n")
    assert main(["run", "--quiet", str(folder)]) == 0
    assert capsys.readouterr().out == "from the folder\n" and sys.path == before
    # a zip of __main__.py has itself first on sys.path, not the folder it lies in, as with `python app.zip`
    import zipfile

    (tmp_path / "beside_the_zip.py").write_text("")
    with zipfile.ZipFile(tmp_path / "app.zip", "w") as z:
        z.writestr("__main__.py", "import importlib.util\nprint(importlib.util.find_spec('beside_the_zip'))\n")
    plain = subprocess.run([sys.executable, str(tmp_path / "app.zip")], capture_output=True, text=True, timeout=60)
    assert main(["run", "--quiet", str(tmp_path / "app.zip")]) == 0
    assert capsys.readouterr().out == plain.stdout == "None\n" and sys.path == before
    (tmp_path / "empty").mkdir()
    assert main(["run", str(tmp_path / "empty")]) == 2
    assert "is a folder without a __main__.py" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "no such script" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--page-size", "0", str(script)])
    assert "must be at least 1, got 0" in capsys.readouterr().err


def test_run_gives_the_script_an_absolute_file(tmp_path, capsys, monkeypatch):
    # as `python script.py` on Python 3.9 and later: a script that changes folder still finds files beside it
    (tmp_path / "data.txt").write_text("beside the script")
    (tmp_path / "reads.py").write_text(textwrap.dedent("""
        import os, sys
        here = os.path.dirname(__file__)
        os.chdir("/")
        print(os.path.isabs(__file__), os.path.basename(sys.argv[0]), open(os.path.join(here, "data.txt")).read())
    """))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--quiet", "reads.py"]) == 0
    assert capsys.readouterr().out == "True reads.py beside the script\n"


_RUN_ENV = ("ASTRAI_HF_MAX_TOKENS", "ASTRAI_HF_PAGE_SIZE", "ASTRAI_HF_MAX_REQS", "ASTRAI_HF_PREFIX_CACHE")


def test_run_runs_the_script_as_python_does_and_leaves_the_callers_process_as_it_was(
        tmp_path, capsys, monkeypatch, request):
    # as `python exits.py --model gpt2 x`: its own arguments (its own --model among them), as __main__, its exit
    # code; after it (and after sizes refused before it) sys.argv, the ASTRAI_HF_* variables and the logger are
    # the caller's again: a refusal had left its variables and a logging handler behind (each later patch logged
    # twice)
    for name in _RUN_ENV:
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "exits.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        if __name__ == "__main__":
            print(sys.argv[1:], *(os.environ.get(f"ASTRAI_HF_{n}") for n in ("PREFIX_CACHE", "PAGE_SIZE", "MAX_REQS")))
            sys.exit(3)
    """))
    request.addfinalizer(lambda level=autopatch.logger.level: autopatch.logger.setLevel(level))
    autopatch.logger.setLevel(logging.WARNING)  # (a level of the caller's own, not run's INFO)
    before = list(sys.argv), list(autopatch.logger.handlers), logging.WARNING

    def left_as_it_was():
        assert (sys.argv, autopatch.logger.handlers, autopatch.logger.level) == before
        assert not [name for name in _RUN_ENV if name in os.environ]

    with pytest.raises(SystemExit) as e:
        main(["run", "--no-prefix-cache", "--page-size", "8", "--max-reqs", "5", str(script), "--model", "gpt2", "x"])
    assert e.value.code == 3 and capsys.readouterr().out == "['--model', 'gpt2', 'x'] 0 8 5\n"
    left_as_it_was()
    assert main(["run", "--max-tokens", "8", "--page-size", "16", str(script)]) == 2
    assert capsys.readouterr().err == "astrai-hf run: max_tokens=8 is smaller than one page (page_size=16)\n"
    left_as_it_was()


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("leave_by", ["return", "exception"])
def test_patched_context_restores_the_model(leave_by):
    model = tiny_model("qwen2")
    twin = copy.deepcopy(model)
    ids, mask = left_padded_batch([3, 8, 12], seed=3)
    attn = model.config._attn_implementation
    with pytest.raises(RuntimeError) if leave_by == "exception" else _nothing():
        with astrai_hf.patched(model, max_tokens=512) as m:
            assert m is model and astrai_hf.is_patched(model)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
            if leave_by == "exception":
                raise RuntimeError("user code failed")
    assert not astrai_hf.is_patched(model)
    assert "generate" not in model.__dict__ and "forward" not in model.__dict__
    assert model.config._attn_implementation == attn
    assert torch.equal(_logits(model, ids, mask), _logits(twin, ids, mask))  # bit-identical
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=5)
    assert torch.equal(model.generate(ids, **kw), twin.generate(ids, **kw))


def test_patched_keeps_an_already_patched_model_patched():
    model = tiny_model("llama")
    pool = astrai_hf.PagePool.from_model(model, max_tokens=256)
    astrai_hf.patch(model, pool=pool)
    try:
        with astrai_hf.patched(model, pool=astrai_hf.PagePool.from_model(model, max_tokens=512)):
            assert astrai_hf.get_pool(model) is not pool
        assert astrai_hf.is_patched(model) and astrai_hf.get_pool(model) is pool
    finally:
        astrai_hf.unpatch(model)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("site", [False, True], ids=["no install", "beside an install of another checkout"])
def test_a_source_checkout_on_sys_path_finds_its_own_patches(tmp_path, site):
    # patches/ ships inside the package as astrai_hf.patches only in an install (pyproject.toml's package-dir);
    # the checkout put on sys.path had failed patch() with "cannot import name 'patches'" (-S: no site .pth files,
    # no install finds it). Beside an editable install of another checkout, that one's patches must not be mixed in
    import shutil

    here = Path(astrai_hf.__file__).resolve().parent.parent
    root = tmp_path / "checkout"
    for name in ("astrai_hf", "patches"):
        shutil.copytree(here / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(here / "pyproject.toml", root)
    site_packages = [p for p in sys.path if p.endswith("site-packages")]
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(root)!r}, {str(here / "tests")!r}]
        sys.path += {site_packages!r}
        import torch, astrai_hf, astrai_hf.patches.autopatch
        assert list(astrai_hf.__path__) == [{str(root / "astrai_hf")!r}], astrai_hf.__path__  # (no other folder)
        from tiny_models import tiny_model
        model = tiny_model("llama")
        with astrai_hf.patched(model, max_tokens=256):
            print(astrai_hf.patches.__file__, model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2).tolist())
        """)
    done = subprocess.run([sys.executable, *([] if site else ["-S"]), "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    path, tokens = done.stdout.split(" ", 1)
    assert Path(path) == root / "patches" / "__init__.py" and len(json.loads(tokens)[0]) == 5
