"""Building a complete `tokenizers` JSON where the checkpoint has no tokenizer.json.

- `from_gguf_vocab`: a GGUF stores its vocabulary, merges and token types as metadata.
  The tokenizer built here matches what transformers builds from the same file
  (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`): gpt2-style byte-level BPE
  (`tokenizer.ggml.model == "gpt2"`) with the split regex named by `tokenizer.ggml.pre`,
  or SentencePiece-style BPE with byte fallback (`"llama"`), merges recovered from scores.
- `byte_level`: a byte-level tokenizer generated for a random model's vocab size.
"""
from __future__ import annotations

from typing import Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells tokens with it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex (the table transformers uses). Any other value (gpt2,
# smollm, ...) gets GPT-2's own regex, built into the ByteLevel pre-tokenizer.
GGUF_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}

CONTROL, USER_DEFINED = 3, 4   # llama.cpp token types


def _post_processor(bos: Optional[str], bos_id: Optional[int]):
    if bos is None:
        return processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                         special_tokens=[(bos, bos_id)])


def _add_typed_tokens(tok: Tokenizer, tokens: list[str], types: list[int],
                      allowed: Optional[set] = None) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so
    both are matched whole in text. A control token spelled outside a byte-level alphabet is
    a llama.cpp mislabel and is skipped (as transformers does)."""
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty == CONTROL and (allowed is None or set(t) <= allowed)]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == USER_DEFINED]
    if user:
        tok.add_tokens(user)


def _gpt2_bpe(tokens: list[str], merges: Optional[list[str]],
              pre: Optional[str]) -> tuple[Tokenizer, set]:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    if merges is None:     # none stored: the ones the vocabulary implies, in id order
        pairs = merges_from_scores(list(vocab), None)
    else:
        pairs = [tuple(m.split(" ")) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    split = GGUF_PRE_SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def merges_from_scores(tokens: list[str], scores: Optional[list[float]]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: every split of a token into two tokens, best score
    first, or lowest id first without scores (transformers' `generate_merges`)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    reverse = scores is not None
    out = []
    for tok, score in zip(tokens, scores if reverse else range(len(tokens))):
        local = [(tok[:k], tok[k:], score) for k in range(1, len(tok))
                 if tok[:k] in vocab and tok[k:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        out.extend(local)
    out.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=reverse)
    return [(a, b) for a, b, _ in out]


def _sentencepiece_bpe(tokens: list[str], scores: list[float], unk: Optional[str],
                       add_space_prefix: bool) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_scores(tokens, scores),
                               unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    seq = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        seq.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(seq)
    return tok


def from_gguf_vocab(meta: dict, where: str) -> str:
    """tokenizer.json content from a GGUF's `tokenizer.ggml.*` metadata (`meta`: key -> value).

    Raises ValueError (with `where` in the message) for a tokenizer model it cannot build.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{where}: no tokenizer.ggml.tokens in the metadata")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    if kind == "gpt2":
        tok, alphabet = _gpt2_bpe(tokens, meta.get("tokenizer.ggml.merges"),
                                  meta.get("tokenizer.ggml.pre"))
        _add_typed_tokens(tok, tokens, types, alphabet)
    elif kind == "llama":
        unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
        unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        tok = _sentencepiece_bpe(tokens, scores, unk,
                                 meta.get("tokenizer.ggml.add_space_prefix", True))
        _add_typed_tokens(tok, tokens, types)
    else:
        raise ValueError(f"{where}: tokenizer.ggml.model {kind!r} is not supported; "
                         "supported: gpt2, llama")
    bos = tokens[bos_id] if add_bos and bos_id is not None else None
    tok.post_processor = _post_processor(bos, bos_id)
    return tok.to_str()


def byte_level(vocab_size: int, bos_id: int, eos_id: int) -> str:
    """A byte-level tokenizer of exactly `vocab_size` ids for a random model.

    bos is `<s>`, eos `</s>` (one `<|endoftext|>` if they share an id), at their ids; the 256
    byte symbols fill the free ids in order, then `<|reserved_N|>` special tokens pad to
    vocab_size. With fewer free ids than 256, the bytes that do not fit map to `<unk>`.
    """
    specials = {bos_id: "<s>", eos_id: "</s>"} if bos_id != eos_id else {bos_id: "<|endoftext|>"}
    for i in specials:
        if not 0 <= i < vocab_size:
            raise ValueError(f"special token id {i} outside vocab_size {vocab_size}")
    free = [i for i in range(vocab_size) if i not in specials]
    unk = None
    if len(free) < 256:
        unk = "<unk>"
        specials[free.pop(0)] = unk
    symbols = list(bytes_to_unicode().values())
    vocab = dict(zip(symbols, free))
    vocab.update({t: i for i, t in specials.items()})
    reserved = {i: f"<|reserved_{i}|>" for i in free[len(symbols):]}
    vocab.update({t: i for i, t in reserved.items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk, dropout=None,
                               fuse_unk=unk is not None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    added = {**specials, **reserved}
    tok.add_special_tokens([AddedToken(added[i], normalized=False, special=True)
                            for i in sorted(added)])
    tok.post_processor = _post_processor(None, None)
    return tok.to_str()
