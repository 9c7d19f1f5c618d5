"""The astrai-hf command's argument handling (the commands themselves are run in other tests)."""

import pytest
import torch

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
    assert err.strip() == f"astrai-hf: cannot load the model: model path {missing!r} does not exist"


@pytest.mark.parametrize("name", ["missing.gguf", "sub/missing.GGUF"])
def test_a_missing_gguf_file_is_one_line_not_a_hub_lookup(name, tmp_path, monkeypatch, capsys):
    # a relative .gguf name had gone to the hub as a model id (couldn't connect to huggingface.co)
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "hi", "--model", name]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"astrai-hf: cannot load the model: model path {name!r} does not exist"


def test_a_file_that_is_no_gguf_file_is_one_line(tmp_path, capsys):
    # transformers took it for a config file: "is not a valid JSON file"
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    assert main(["generate", "hi", "--model", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"astrai-hf: cannot load the model: model path {str(path)!r} is a file, not a .gguf file")
    assert "\n" not in err


def test_the_model_option_names_gguf_files(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert ".gguf file" in " ".join(capsys.readouterr().out.split())


def test_a_model_folder_without_tokenizer_files_is_one_line(tmp_path, capsys):
    # transformers' error began with a fragment of a sentence spread over several lines
    from tiny_models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path)
    capsys.readouterr()  # (save_pretrained's progress bar)
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"astrai-hf: cannot load the model: model folder {str(tmp_path)!r} has no tokenizer files")
    assert "\n" not in err and "tokenizer.save_pretrained(folder)" in err


@pytest.mark.parametrize("value", ["0", "-2"])
def test_bench_repeats_below_one_is_refused_naming_the_value(value, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--suite", "prefill", "--repeats", value])
    assert f"must be at least 1, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "hi", "--max-new-tokens", "0"], ["demo", "--max-new-tokens", "-3"],
                                  ["generate", "hi", "--max-new-tokens", "many"]])
def test_new_token_counts_below_one_are_refused_naming_the_value(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert f"got {argv[-1]}" in capsys.readouterr().err.replace("'", "")


def test_a_folder_that_is_not_a_causal_lm_is_one_line(tmp_path, capsys):
    import transformers

    transformers.T5Config().save_pretrained(tmp_path)
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("astrai-hf: cannot load the model: ") and "\n" not in err


def test_a_model_astrai_hf_cannot_patch_is_one_line(monkeypatch, capsys):
    from tiny_models import tiny_model

    unpatchable = tiny_model("falcon", new_decoder_architecture=False, multi_query=False, num_kv_heads=4, alibi=True)
    monkeypatch.setattr(astrai_hf.models, "load_model", lambda path=None: (unpatchable, None))
    assert main(["generate", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("astrai-hf: NotImplementedError: ") and "FalconForCausalLM" in err and "\n" not in err


def test_a_plot_path_in_a_folder_not_there_yet_is_made_before_the_suites_run(tmp_path, monkeypatch):
    monkeypatch.setattr(astrai_hf.models, "load_model", lambda path=None: (_ for _ in ()).throw(_Loaded(path)))
    plot = tmp_path / "new" / "folder" / "chart.png"
    with pytest.raises(_Loaded):
        main(["bench", "--plot", str(plot)])
    assert plot.parent.is_dir()


@pytest.mark.parametrize("argv", [
    ["bench", "--out", "{file}"],
    ["bench", "--plot", "{file}/chart.png"],
    ["bench", "--plot", "{folder}"],
    ["bench", "--plot", "{folder}/chart.xyz"],
    ["bench", "--plot", "{folder}/chart.pgf"],
])
def test_an_output_path_that_cannot_be_written_is_one_line_before_the_model_loads(argv, tmp_path, monkeypatch,
                                                                                  capsys):
    monkeypatch.setattr(astrai_hf.models, "load_model", lambda path=None: (_ for _ in ()).throw(_Loaded(path)))
    (tmp_path / "a_file").write_text("")
    argv = [a.format(file=tmp_path / "a_file", folder=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and any(w in err for w in ("cannot make the folder", "is a folder", ".png")), err


@pytest.mark.parametrize("where", ["before run", "after run"])
def test_model_with_run_is_refused_not_ignored(where, tmp_path, capsys):
    # after run, argparse had taken the model id for the script and named --model alone as unrecognized
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit(7)\n")
    argv = ["--model", "some/folder", "run", str(script)] if where == "before run" else [
        "run", "--model", "some/folder", str(script)]
    assert main(argv) == 2
    assert "--model does not apply to run" in capsys.readouterr().err


def test_an_unknown_option_is_named_with_the_commands_own_usage(capsys):
    # the top-level usage had been shown, which lists none of generate's options
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--max-tokens", "5"])
    err = capsys.readouterr().err
    assert "usage: astrai-hf generate" in err and "--max-new-tokens" in err
    assert "unrecognized arguments: --max-tokens 5" in err


@pytest.mark.parametrize("after", [["--", "a"], ["a", "--", "b"], ["--"], ["--", "--quiet"]])
def test_run_hands_the_script_the_arguments_python_would(after, tmp_path, capsys):
    # argparse dropped a "--" right after the script: `run s.py -- a` gave ['a'] where `python s.py -- a` gives
    # ['--', 'a']
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint(sys.argv[1:])\n")
    assert main(["run", "--quiet", str(script), *after]) in (0, None)
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(after)


def test_run_without_a_script_names_the_script_alone(capsys):
    # the script's own arguments are optional: the message had named them as missing too
    with pytest.raises(SystemExit):
        main(["run", "--report"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("the following arguments are required: script"), err


def test_a_first_line_that_ends_in_a_colon_keeps_what_follows():
    from astrai_hf.cli import _first_line

    error = ValueError("Couldn't instantiate the backend tokenizer from one of:\n(1) a `tokenizers` file\n(2) ...")
    assert _first_line(error) == "Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` file"
    assert _first_line(OSError("no such file\nmore")) == "no such file"


@pytest.mark.compat
def test_load_model_lets_transformers_pick_the_attention_a_family_supports(tmp_path):
    # Gemma 2 with its attention softcapping refuses sdpa: a default of sdpa made --model refuse the family
    import shutil

    import transformers as T

    from astrai_hf.models import embedded_model_path, load_model

    config = T.Gemma2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    T.Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    for f in embedded_model_path().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    model, tokenizer = load_model(str(tmp_path))
    # transformers' own choice: eager on 5.24 (softcapping), sdpa on releases whose Gemma 2 took it
    picked = T.AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation
    assert type(model).__name__ == "Gemma2ForCausalLM" and model.config._attn_implementation == picked
    assert tokenizer.padding_side == "left"


@pytest.mark.parametrize("form", ["pathlib.Path", "~/folder"])
def test_load_model_takes_a_path_object_and_a_folder_under_the_home_folder(form, tmp_path, monkeypatch):
    # a pathlib.Path had failed on .lower(), and "~/folder" had gone to transformers unexpanded (a bad hub id)
    import pathlib
    import shutil

    import transformers as T

    from astrai_hf.models import embedded_model_path, load_model

    folder = tmp_path / "models" / "tiny"
    config = T.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
    T.LlamaForCausalLM(config).save_pretrained(folder)
    for f in embedded_model_path().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    monkeypatch.setenv("HOME", str(tmp_path))
    name = pathlib.Path(folder) if form == "pathlib.Path" else "~/models/tiny"
    model, tokenizer = load_model(name)
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer.padding_side == "left"
    with pytest.raises(TypeError, match="name must be a str, a path or None, got int"):
        load_model(3)


def test_a_folder_without_a_config_is_one_line_naming_what_is_missing(tmp_path, capsys):
    # transformers tried the tokenizer first, and the line ended mid-sentence on tokenizer libraries
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"astrai-hf: cannot load the model: model folder {str(tmp_path)!r} has no config.json: it is not "
                   "a folder save_pretrained() wrote (a model's config, weights and tokenizer files; or a peft "
                   "adapter's)")


def test_the_embedded_model_without_gguf_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    # transformers' ImportError had ended the command in a traceback
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(astrai_hf.models, "cache_dir", lambda: tmp_path)  # no converted copy yet
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    assert main(["generate", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("astrai-hf: cannot load the model: the embedded model is converted once from the GGUF")
    assert "pip install 'astrai-hf[gguf]'" in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"astrai-hf {astrai_hf.__version__}"


def test_a_peft_adapter_folder_loads_as_transformers_loads_it(tmp_path):
    # it holds adapter_config.json and no config.json: the folder check had refused it
    import peft
    import transformers

    from astrai_hf.models import load_model

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    adapter = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"),
                                  peft.LoraConfig(r=2, target_modules=["q_proj"]))
    adapter.save_pretrained(tmp_path / "adapter")
    from tokenizers import Tokenizer, models

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w1").save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "config.json").exists()
    model, tokenizer = load_model(str(tmp_path / "adapter"))
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")
    assert type(model) is type(stock) and tokenizer.padding_side == "left"
    for got, want in zip(model.state_dict().values(), stock.state_dict().values()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device, text", [("nowhere", "device 'nowhere' is not a torch device"),
                                          pytest.param("cuda:7", "'cuda:7': this process sees [0-7] CUDA devices",
                                                       marks=pytest.mark.skipif(torch.cuda.device_count() > 7,
                                                                                reason="a machine with 8 GPUs"))])
def test_load_model_names_a_device_it_cannot_use_before_loading(device, text, monkeypatch):
    # it had loaded the weights first, then failed in model.to() (an AssertionError for CUDA on a CPU build)
    import transformers as T

    from astrai_hf.models import load_model

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the device was checked")

    monkeypatch.setattr(T.AutoModelForCausalLM, "from_pretrained", no_load)
    monkeypatch.setattr(T.AutoTokenizer, "from_pretrained", no_load)
    with pytest.raises(ValueError, match=text):
        load_model(device=device)


def test_a_first_line_of_an_error_without_a_message_is_its_class():
    from astrai_hf.cli import _first_line

    assert _first_line(OSError()) == "OSError" and _first_line(ValueError("  \n ")) == "ValueError"


def test_token_counts_default_to_what_the_help_says(monkeypatch, capsys):
    import astrai_hf.cli as cli

    seen = []
    monkeypatch.setattr(astrai_hf.models, "load_model", lambda path=None: (None, None))
    monkeypatch.setattr(cli, "_demo", lambda model, tokenizer, n: seen.append(("demo", n)) or 0)
    monkeypatch.setattr(cli, "_generate", lambda model, tokenizer, prompt, n, sample: seen.append((prompt, n)) or 0)
    assert main(["demo"]) == main(["generate", "hi"]) == 0
    assert seen == [("demo", 48), ("hi", 128)]
    for command, default in (("demo", 48), ("generate", 128)):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert f"(default {default})" in capsys.readouterr().out


class _ChatTokenizer:
    """What the generate command asks of a tokenizer (a chat template, a batch, decoding), over a tiny model's ids."""

    def apply_chat_template(self, conversation, add_generation_prompt, tokenize):
        return conversation[-1]["content"]

    def __call__(self, texts, return_tensors, padding, add_special_tokens):
        ids = torch.tensor([[3 + len(word) for word in text.split()] for text in texts])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def decode(self, ids, **kwargs):
        return " ".join(str(i) for i in ids)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "--sample"])
def test_generate_samples_only_when_asked(sample, monkeypatch, capsys):
    from tiny_models import tiny_model

    model = tiny_model("llama")
    monkeypatch.setattr(astrai_hf.models, "load_model", lambda path=None: (model, _ChatTokenizer()))
    draws, multinomial = [], torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: draws.append(1) or multinomial(*a, **k))
    try:
        assert main(["generate", "one two three", "--max-new-tokens", "3", *(["--sample"] if sample else [])]) == 0
    finally:
        astrai_hf.unpatch(model)
    assert len(draws) == (3 if sample else 0)
    assert len(capsys.readouterr().out.split()) == 3  # the new tokens, streamed


def test_bench_runs_the_suites_asked_for_with_the_repeats_given(monkeypatch, capsys):
    from astrai_hf import bench, bench_prefill, bench_prefix

    calls = []
    monkeypatch.setattr(astrai_hf.models, "load_model", lambda path=None: ("model", "tokenizer"))
    monkeypatch.setattr(bench, "environment", lambda model: {})
    monkeypatch.setattr(bench, "run", lambda model, tokenizer, progress: calls.append("decode") or ([], {}))
    monkeypatch.setattr(bench, "to_markdown", lambda rows, env: "decode table")
    monkeypatch.setattr(bench_prefix, "run", lambda model, tokenizer, progress: calls.append("prefix"))
    monkeypatch.setattr(bench_prefill, "run",
                        lambda model, tokenizer, repeats, progress: calls.append(f"prefill x{repeats}"))
    for module in (bench_prefix, bench_prefill):
        monkeypatch.setattr(module, "to_markdown", lambda results, env, name=module.__name__: f"{name} table")
        monkeypatch.setattr(module, "as_dict", lambda results: {})
    assert main(["bench"]) == 0
    assert calls == ["decode", "prefix", "prefill x3"]
    assert [line for line in capsys.readouterr().out.splitlines() if line.endswith("table")] == [
        "decode table", "astrai_hf.bench_prefix table", "astrai_hf.bench_prefill table"]
    calls.clear()
    assert main(["bench", "--suite", "prefill", "--repeats", "5"]) == 0
    assert calls == ["prefill x5"]
