"""Megatron-LM's own derivation rules, applied to a :class:`~orchestrator.convert.to_config.Conversion`.

Each function reads the flags it owns and sets orchestrator keys the way Megatron-LM's
``validate_args`` would have set its arguments, writing the arithmetic into ``derived`` and what
it had to assume into ``assumed``: the tokenizer and its vocabulary, the data blend, checkpoints
(``--save``/``--load`` -> the run directory), TensorBoard, grouped-query attention, the SwiGLU MLP
width, max positions, VPP from layers per virtual stage, a stated DP against the world size, the
default global batch, warm-up from a fraction and samples -> iterations. Pure Python.
"""

from __future__ import annotations

import math
from pathlib import PurePosixPath
from typing import Dict

from orchestrator.config.ramp import iterations_for
from orchestrator.convert import megatron_args as M
from orchestrator.convert.conversion import Conversion, fail, number
from orchestrator.convert.ramp_flags import rampup
from orchestrator.convert.sources import Arg, runtime_mark

GPT2_FILES = ("--vocab-file", "--merge-file")


def unread_values(given: Dict[str, Arg]) -> tuple:
    """Flags whose values no rule reads: :data:`PRESENCE_ONLY`, and GPT-2's files with mock data."""
    kind = given.get("--tokenizer-type")
    mock = "--data-path" not in given and (kind is None or kind.values == ["GPT2BPETokenizer"])
    return PRESENCE_ONLY + (GPT2_FILES if mock else ())


def _mock_vocabulary(conv: Conversion, given: Dict[str, Arg]) -> None:
    """Mock data reads no text: GPT-2's vocabulary as NullTokenizer ids, no vocab/merge file needed."""
    for flag in GPT2_FILES:
        if flag in given:
            conv.not_converted.append(
                f"{given[flag].text}: mock data reads no text; the vocabulary is GPT-2 "
                f"BPE's {M.GPT2_BPE_VOCAB} ids without the file"
            )
            conv.status[flag] = "not converted"
    conv.set("data.tokenizer", "NullTokenizer", "mock data: token ids only (no text to tokenize)")
    conv.set("data.vocab_size", M.GPT2_BPE_VOCAB, f"GPT-2 BPE's {M.GPT2_BPE_VOCAB} ids, eod {M.GPT2_BPE_VOCAB - 1}")
    conv.assumed.append(
        f"tokenizer: mock data, so only the vocabulary counts: NullTokenizer with GPT-2 BPE's "
        f"{M.GPT2_BPE_VOCAB} ids (Megatron-LM's GPT2BPETokenizer vocabulary), no vocab/merge file"
    )
    conv.tokenizer_vocab = M.GPT2_BPE_VOCAB


def tokenizer(conv: Conversion, given: Dict[str, Arg]) -> None:
    """``--tokenizer-type`` and its files -> data.tokenizer (+ vocab_file, merge_file, tokenizer_model, vocab_size)."""
    if not conv.from_export and GPT2_FILES[0] in unread_values(given) and "--vocab-size" not in given:
        return _mock_vocabulary(conv, given)
    words = {
        f: number(given[f], "str")
        for f in ("--tokenizer-type", "--vocab-file", "--merge-file", "--tokenizer-model")
        if f in given
    }
    size = number(given["--vocab-size"], "int") if "--vocab-size" in given else None
    kind = words.get("--tokenizer-type")
    if kind is None:
        if conv.from_export:
            return
        kind = "GPT2BPETokenizer"
        why = (
            "--vocab-file and --merge-file are GPT-2 BPE files"
            if "--vocab-file" in words
            else "no tokenizer flag; the GPT-2 BPE of Megatron-LM's GPT examples (state --tokenizer-type if not)"
        )
        conv.assumed.append(f"tokenizer: GPT2BPETokenizer ({why}): vocabulary {M.GPT2_BPE_VOCAB}")
    src = (
        given["--tokenizer-type"].text
        if "--tokenizer-type" in given
        else "inferred from --vocab-file/--merge-file"
        if "--vocab-file" in words
        else "assumed: no tokenizer flag"
    )
    eod = number(given["--null-tokenizer-eod-id"], "int") if "--null-tokenizer-eod-id" in given else None
    byte = dict(M.BYTE_NULL_TOKENIZER)
    if kind == "NullTokenizer" and (
        (size, eod) == (int(byte["--vocab-size"]), int(byte["--null-tokenizer-eod-id"]))
        or (size == M.NULL_TOKENIZER_BYTE_VOCAB and eod is None)
    ):
        conv.set("data.tokenizer", "byte", f"{src} --vocab-size {size}: byte ids 0-255 + eod 256")
        return
    if kind == "HuggingFaceTokenizer" and "--tokenizer-model" in words:
        model = words["--tokenizer-model"]
        path = model if model.endswith(".json") or not model.startswith(("/", ".", "~")) else f"{model}/tokenizer.json"
        conv.set("data.tokenizer", path, f"{src} --tokenizer-model {model}")
    else:
        conv.set("data.tokenizer", kind, src)
    for flag, key in (("--vocab-file", "data.vocab_file"), ("--merge-file", "data.merge_file")):
        if flag in words:
            conv.set(key, words[flag], given[flag].text)
    if "--tokenizer-model" in words and kind != "HuggingFaceTokenizer":
        conv.set("data.tokenizer_model", words["--tokenizer-model"], given["--tokenizer-model"].text)
    if kind == "NullTokenizer" and size is not None and eod is not None:  # megatron-core's: size ids, eod stated
        conv.set("data.vocab_size", size, given["--vocab-size"].text)
        conv.set("data.eod_id", eod, given["--null-tokenizer-eod-id"].text)
    elif kind == "NullTokenizer" and size is not None:  # older Megatron-LM's legacy NullTokenizer added the eod
        conv.set("data.vocab_size", size + 1, f"--vocab-size {size} + 1 (NullTokenizer adds eod)")
    elif size is not None:
        conv.set("data.vocab_size", size, given["--vocab-size"].text)
    elif kind == "GPT2BPETokenizer":
        conv.set("data.vocab_size", M.GPT2_BPE_VOCAB, "GPT2BPETokenizer: 50257 ids")
    conv.tokenizer_vocab = conv.get("data.vocab_size")


def data(conv: Conversion, given: Dict[str, Arg]) -> None:
    """``--data-path [w1] p1 [w2 p2 ...]`` -> data=indexed with paths/weights; ``--mock-data`` -> data=mock."""
    if "--data-path" in given:
        arg = given["--data-path"]
        words = " ".join(arg.values).split()
        if any("$" in w for w in words):
            raise fail(
                "--data-path",
                f"{' '.join(words)!r} contains a shell variable the script does not define",
                "define it in the script or pass --var NAME=VALUE",
            )
        try:
            weights = [float(w) for w in words[0::2]] if len(words) % 2 == 0 and len(words) > 1 else None
        except ValueError:
            weights = None
        paths = words[1::2] if weights is not None else words
        conv.groups["data"] = "indexed"
        conv.set("data.paths", paths, arg.flag + " (paths)" + runtime_mark(arg.runtime))
        conv.set("data.weights", weights, arg.flag + (" (weights)" if weights else ": no weights given"))
        if "--split" not in given:
            conv.set("data.split", M.MEGATRON_DEFAULT_SPLIT, "Megatron-LM's --split with --data-path")
            conv.defaults.append(f"--split {M.MEGATRON_DEFAULT_SPLIT!r}")
    elif "--mock-data" in given:
        conv.groups["data"] = "mock"
    elif not conv.from_export:
        conv.groups["data"] = "mock"
        conv.assumed.append(
            "data: no --data-path, so data=mock (synthetic tokens); "
            "set data=indexed data.paths=[<prefix>, ...] for your .bin/.idx files"
        )


PRESENCE_ONLY = ("--tensorboard-dir",)
"""Flags whose value no rule reads (only that they are given): an undefined variable there is harmless."""


def tensorboard(conv: Conversion, given: Dict[str, Arg]) -> None:
    """``--tensorboard-dir DIR`` -> logging.tensorboard (events go to <run dir>/tensorboard)."""
    if "--tensorboard-dir" in given:
        arg = given["--tensorboard-dir"]
        conv.set("logging.tensorboard", True, f"{arg.text}: events go to <run dir>/tensorboard")


def checkpoints(conv: Conversion, given: Dict[str, Arg]) -> None:
    """``--save``/``--load`` -> run.root/run.name (checkpoints in <run dir>/checkpoints), resume, save at end."""
    save, load = (
        (number(given[f], "str") or "").rstrip("/") or None if f in given else None for f in ("--save", "--load")
    )
    base = save or load
    conv.set(
        "checkpoint.save_at_end",
        save is not None,
        "--save given" if save else "no --save: Megatron-LM saves no checkpoint",
    )
    resume = load is not None and (save is None or load == save)
    conv.set("checkpoint.auto_resume", resume, "--load (same directory)" if resume else "no --load: no resume")
    if load is not None and not resume:
        conv.not_converted.append(
            f"--load {load}: a Megatron-LM checkpoint (no orchestrator manifest); a run "
            "resumes from its own run directory, --save's"
        )
        conv.status["--load"] = "not converted"
    if base is None:
        return
    path = PurePosixPath(base)
    run_dir = path.parent if path.name == "checkpoints" else path
    flag = "--save" if save else "--load"
    said = f"{flag} {base}{runtime_mark(given[flag].runtime)}"
    if path.name != "checkpoints":
        conv.derived.append(f"{said}: run directory {base}; checkpoints go to {base}/checkpoints")
    conv.set("run.root", str(run_dir.parent), f"{said}: run directory {run_dir}")
    conv.set("run.name", run_dir.name, said)


# ---- model and layout arithmetic ------------------------------------------------------------


def model(conv: Conversion, given: Dict[str, Arg]) -> None:
    """Grouped-query attention, the SwiGLU MLP width and max positions, as Megatron-LM derives them."""
    gqa = "--group-query-attention" in given
    if "--num-query-groups" in given:
        groups = number(given["--num-query-groups"], "int")
        if gqa:
            conv.set("model.num_query_groups", groups, f"--group-query-attention {given['--num-query-groups'].text}")
        else:
            conv.flagged.append(
                f"{given['--num-query-groups'].text}: Megatron-LM ignores it without "
                "--group-query-attention (multi-head attention); not converted"
            )
            conv.status["--num-query-groups"] = "flagged"
    elif gqa:
        conv.set("model.num_query_groups", 1, "--group-query-attention: Megatron-LM's default --num-query-groups 1")
    if "--ffn-hidden-size" in given:
        conv.set("model.ffn_hidden_size", number(given["--ffn-hidden-size"], "int"), given["--ffn-hidden-size"].text)
    elif conv.get("model.activation") == "swiglu" and conv.get("model.hidden_size"):
        h = conv.get("model.hidden_size")
        ffn = M.swiglu_ffn_hidden_size(h)
        text = f"--swiglu without --ffn-hidden-size: int(4 x {h} x 2/3 / 64) x 64 = {ffn}"
        conv.set("model.ffn_hidden_size", ffn, text)
        conv.derived.append(f"model.ffn_hidden_size = {text}")
    if "--max-position-embeddings" not in given and conv.get("model.seq_length") and not conv.from_export:
        seq = conv.get("model.seq_length")
        conv.set("model.max_position_embeddings", seq, "not given: = --seq-length")
        conv.assumed.append(
            f"model.max_position_embeddings: --max-position-embeddings not given (Megatron-LM needs "
            f"it >= --seq-length with learned positions); set to --seq-length {seq}"
        )


def batches_and_schedule(conv: Conversion, given: Dict[str, Arg]) -> None:
    """Megatron-LM's derived batch and schedule values: GBS = MBS x DP, warm-up from a fraction, samples -> iters."""
    mbs, world = conv.get("training.micro_batch_size"), conv.world_size
    if "--global-batch-size" not in given and mbs and world:
        mp = 1
        for k in ("tensor_model", "pipeline_model", "context"):
            mp *= conv.get(f"parallelism.{k}_parallel_size", 1)
        dp = max(1, world // mp)
        conv.set("training.global_batch_size", mbs * dp, f"Megatron-LM default: MBS x DP = {mbs} x {dp}")
        conv.derived.append(
            f"training.global_batch_size = MBS x DP = {mbs} x {dp} = {mbs * dp} (Megatron-LM's default)"
        )
    gbs = conv.get("training.global_batch_size")
    ramp = rampup(conv, given)
    for flag, key in (
        ("--train-samples", "training.train_iters"),
        ("--lr-decay-samples", "optimizer.lr_decay_iters"),
        ("--lr-warmup-samples", "optimizer.lr_warmup_iters"),
    ):
        if flag in given:
            if not gbs:
                raise fail(
                    key,
                    f"{given[flag].text} needs the global batch size to count iterations",
                    "give --global-batch-size",
                )
            samples = number(given[flag], "int")
            if ramp and flag == "--train-samples":  # Megatron-LM's update_train_iters: iterate the ramp
                iters = iterations_for(ramp, gbs, samples)
                conv.derived.append(f"{key} = {iters}: the iterations that consume {samples} samples on the ramp")
                if "--lr-decay-samples" not in given and "--lr-decay-iters" not in given:  # its decay: train_samples
                    decay = math.ceil(samples / gbs)
                    conv.set("optimizer.lr_decay_iters", decay, f"{given[flag].text} / GBS {gbs}")
                    conv.derived.append(f"optimizer.lr_decay_iters = ceil({samples} / {gbs}) = {decay} (decay samples)")
            else:  # the LR lengths: samples = iters x GBS (Megatron-LM's rule, with a ramp too)
                iters = math.ceil(samples / gbs)
                conv.derived.append(f"{key} = ceil({samples} / {gbs}) = {iters} ({given[flag].text}, GBS)")
            conv.set(key, iters, f"{given[flag].text} / GBS {gbs}")
    if "--lr-warmup-fraction" in given:
        if "--lr-warmup-iters" in given:
            raise fail(
                "optimizer.lr_warmup_iters",
                "--lr-warmup-fraction and --lr-warmup-iters both given (Megatron-LM refuses both)",
                "keep one",
            )
        fraction = number(given["--lr-warmup-fraction"], "float")
        decay = conv.get("optimizer.lr_decay_iters") or conv.get("training.train_iters")
        if not decay:
            raise fail(
                "optimizer.lr_warmup_iters",
                "--lr-warmup-fraction needs --lr-decay-iters or --train-iters",
                "give one of them",
            )
        warmup = round(fraction * decay)
        text = f"lr_warmup_fraction x lr_decay_iters = {fraction:g} x {decay} = {warmup}"
        conv.set("optimizer.lr_warmup_iters", warmup, given["--lr-warmup-fraction"].text + ": " + text)
        conv.derived.append(f"optimizer.lr_warmup_iters = {text}")
