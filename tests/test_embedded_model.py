"""The real model: SmolLM2-135M-Instruct (embedded GGUF), chat prompts as one left-padded batch."""

import pytest
import torch

import astrai_hf
from astrai_hf import PagedCache, PagePool

pytestmark = [pytest.mark.slow, pytest.mark.equivalence]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, as if to a child who asks many questions.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def smollm():
    from astrai_hf.models import embedded_gguf, load_model

    try:
        embedded_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_model()


def _batch(tokenizer):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def test_greedy_64_tokens_identical_to_dynamic_cache(smollm):
    model, tokenizer = smollm
    inputs = _batch(tokenizer)
    assert (inputs["attention_mask"] == 0).any(), "the batch must be left-padded"
    kwargs = dict(max_new_tokens=64, do_sample=False)
    ref = model.generate(**inputs, **kwargs)
    pool = PagePool.from_model(model, max_tokens=4096, page_size=16)
    with PagedCache(pool) as cache:
        out = model.generate(**inputs, **kwargs, past_key_values=cache)
    assert torch.equal(out, ref)
    astrai_hf.patch(model, pool=pool)
    try:
        out = model.generate(**inputs, **kwargs)
    finally:
        astrai_hf.unpatch(model)
    assert torch.equal(out, ref)
    assert pool.stats()["num_used_pages"] == 0
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_cli_generate_answers(smollm, capsys):
    from astrai_hf.cli import main

    assert main(["generate", "What is the capital of France?", "--max-new-tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_a_folder_whose_tokenizer_has_no_pad_token_loads_with_eos_as_pad(smollm, tmp_path):
    # as the docstring says: padding a batch (padding=True) had raised "Asking to pad but the tokenizer does not
    # have a padding token"
    import json
    import shutil

    from astrai_hf.models import embedded_model_path, load_model

    folder = tmp_path / "no-pad"
    folder.mkdir()
    for f in embedded_model_path().iterdir():
        (folder / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, folder / f.name)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("pad_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    _, tokenizer = load_model(folder)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    batch = tokenizer(["a b c", "a"], return_tensors="pt", padding=True)
    assert batch["attention_mask"][1].tolist()[0] == 0


def test_the_converted_folder_loads_padding_on_the_left(smollm, tmp_path, monkeypatch):
    # save_pretrained writes a tokenizer's init kwargs, not its padding_side attribute: the folder had loaded
    # padding on the right, so a plain from_pretrained() script got a batch a patched generate() refuses. A copy
    # converted on transformers 5.17 named the EOS and padding token <|im_start|>: mended too
    import json
    import shutil

    from transformers import AutoTokenizer

    from astrai_hf.models import EMBEDDED_MODEL, embedded_model_path

    folder = embedded_model_path()
    assert AutoTokenizer.from_pretrained(folder).padding_side == "left"
    old = tmp_path / EMBEDDED_MODEL  # a copy an earlier release converted, without padding_side
    old.mkdir()
    for f in folder.iterdir():
        (old / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, old / f.name)
    settings = json.loads((old / "tokenizer_config.json").read_text())
    settings.pop("padding_side", None)
    settings.update(eos_token="<|im_start|>", pad_token="<|im_start|>", eos_token_id=1, pad_token_id=1)
    (old / "tokenizer_config.json").write_text(json.dumps(settings))
    assert AutoTokenizer.from_pretrained(old).eos_token_id == 1
    monkeypatch.setenv("ASTRAI_HF_CACHE", str(tmp_path))
    assert embedded_model_path() == old
    mended = AutoTokenizer.from_pretrained(old)
    assert mended.padding_side == "left"
    assert (mended.bos_token_id, mended.eos_token_id, mended.pad_token_id) == (1, 2, 2)
    assert mended.eos_token == "<|im_end|>"
    written = (old / "tokenizer_config.json").read_text()
    embedded_model_path()  # nothing left to mend: the file is not written again
    assert (old / "tokenizer_config.json").read_text() == written


def _stale_copy(tmp_path):
    """A converted copy as transformers 5.17 wrote it: EOS and padding named <|im_start|>."""
    import json
    import shutil

    from astrai_hf.models import EMBEDDED_MODEL, embedded_model_path

    folder = embedded_model_path()
    old = tmp_path / EMBEDDED_MODEL
    old.mkdir()
    for f in folder.iterdir():
        (old / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, old / f.name)
    settings = json.loads((old / "tokenizer_config.json").read_text())
    settings.update(eos_token="<|im_start|>", pad_token="<|im_start|>")
    (old / "tokenizer_config.json").write_text(json.dumps(settings))
    return old


def test_a_stale_copy_the_process_may_not_write_still_loads_right(smollm, tmp_path, monkeypatch):
    # a cache folder of another user (or baked into an image): mending on disk failed with a read-only error
    import astrai_hf.models as models

    old = _stale_copy(tmp_path)
    monkeypatch.setenv("ASTRAI_HF_CACHE", str(tmp_path))

    def read_only(path, text):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(models, "_write_atomically", read_only)
    before = (old / "tokenizer_config.json").read_text()
    _, tokenizer = models.load_model()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert tokenizer.padding_side == "left"
    assert (old / "tokenizer_config.json").read_text() == before


def test_copies_mended_at_once_by_several_workers_all_load_right(smollm, tmp_path):
    # two processes mending one copy wrote one temporary file: the slower one's rename failed (22 of 100 rounds)
    import json
    import threading

    from transformers import AutoTokenizer

    from astrai_hf.models import _repair_converted_copy

    old = _stale_copy(tmp_path)
    stale = (old / "tokenizer_config.json").read_text()
    failures = []

    def mend(barrier):
        barrier.wait()
        try:
            _repair_converted_copy(old)
        except Exception as e:  # noqa: BLE001 - every failure is the finding
            failures.append(e)

    for _ in range(30):
        (old / "tokenizer_config.json").write_text(stale)
        barrier = threading.Barrier(4)
        workers = [threading.Thread(target=mend, args=(barrier,)) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert failures == []
    assert sorted(p.name for p in old.iterdir() if "partial" in p.name) == []
    assert json.loads((old / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert AutoTokenizer.from_pretrained(old).pad_token_id == 2


def test_a_right_copy_whose_tokens_are_saved_as_added_token_entries_is_left_as_it_is(smollm, tmp_path):
    import json

    from astrai_hf.models import _repair_converted_copy

    old = _stale_copy(tmp_path)
    settings = json.loads((old / "tokenizer_config.json").read_text())
    for kind, token in (("bos", "<|im_start|>"), ("eos", "<|im_end|>"), ("pad", "<|im_end|>")):
        settings[f"{kind}_token"] = {"__type": "AddedToken", "content": token, "lstrip": False, "normalized": False,
                                     "rstrip": False, "single_word": False, "special": True}
    settings["padding_side"] = "left"
    (old / "tokenizer_config.json").write_text(json.dumps(settings))
    stamp = (old / "tokenizer_config.json").stat().st_mtime_ns
    _repair_converted_copy(old)
    assert (old / "tokenizer_config.json").stat().st_mtime_ns == stamp


def test_a_gguf_file_loads_as_the_converted_folder_does(smollm, tmp_path):
    # a path to a .gguf file had gone to from_pretrained() as a folder, which fails on it
    from astrai_hf.models import embedded_gguf, load_model

    model, tokenizer = smollm
    upper = tmp_path / "SmolLM2.GGUF"  # the suffix in any case
    upper.symlink_to(embedded_gguf())
    gguf_model, gguf_tokenizer = load_model(str(upper))
    assert gguf_tokenizer.padding_side == "left"
    # the file's EOS and padding token (transformers 5.17 read the tokenizer's EOS as <|im_start|>, and no padding)
    config = gguf_model.config
    for t in (gguf_tokenizer, tokenizer):
        assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (config.bos_token_id, config.eos_token_id,
                                                                    config.pad_token_id) == (1, 2, 2)
    inputs = _batch(gguf_tokenizer)
    assert torch.equal(inputs["input_ids"], _batch(tokenizer)["input_ids"])
    for a, b in zip(gguf_model.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_weights_saved_private_get_the_permissions_of_the_rest_of_the_copy(smollm, tmp_path):
    # transformers saves model.safetensors 0600: a cache folder shared between users held weights only its
    # writer could read
    from astrai_hf.models import _repair_converted_copy

    old = _stale_copy(tmp_path)
    (old / "model.safetensors").unlink()  # (a symlink to the real copy) -> a file of its own, saved private
    (old / "model.safetensors").write_bytes(b"weights")
    (old / "model.safetensors").chmod(0o600)
    (old / "config.json").chmod(0o644)
    _repair_converted_copy(old)
    assert {f.name: f.stat().st_mode & 0o777 for f in old.iterdir()}["model.safetensors"] == 0o644
