"""Trains the embedded default model: a small Llama on the King James Bible, on CPU, reproducibly.

    python -m jaxinfer.train --out jaxinfer/assets/default_model [--corpus PATH] [--steps N]

Steps: (a) get the corpus (Debian's `bible-kjv-text` package: a .deb, its extracted tree, or its
`bible.data` file; with no `--corpus`, `apt-get download` fetches the .deb into a temp dir) and
decode it to one verse per line; the last `--heldout-frac` of the verses (the end of the New
Testament) are held out. (b) Train a SentencePiece BPE tokenizer on the training verses
(byte_fallback: any text round-trips). (c) Train the project's own Llama (the parameter pytree of
`jaxinfer.model`) with AdamW and a warmup + cosine schedule, on windows that start with BOS at a
verse boundary, like a prompt does. (d) Report held-out perplexity. (e) Write the checkpoint with
`jaxinfer.checkpoint.save`, plus the corpus word list the tests check generations against.

Training uses `train_logits`, a plain full-sequence causal forward over the same parameter tree
and the same layer modules (RMSNorm, MLP, RoPE) as the paged `prefill`/`decode_step`;
`check_against_prefill` confirms the two give the same logits. Every random choice is seeded.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import model
from jaxinfer.config import ModelConfig, SlidingWindow
from jaxinfer.errors import InvalidRequestError
from jaxinfer.kv_cache import Batch, KVCache

BOS, EOS = 1, 2

# ----------------------------------------------------------------------------------------------
# (a) The corpus.


def _unlzw(data: bytes) -> bytes:
    """Decodes Unix `compress` (.Z, LZW) data, the format of bible-kjv's text blocks.

    Codes start 9 bits wide and grow to `maxbits`; in block mode code 256 clears the table. The
    encoder emits codes in groups of eight, so whenever the width changes (or the table is cleared)
    the reader skips to the end of the current group of `8 * width` bits.
    """
    if data[:2] != b"\x1f\x9d":
        raise ValueError("not compress (.Z) data")
    maxbits, block_mode = data[2] & 0x1F, bool(data[2] & 0x80)
    body = data[3:] + b"\0\0\0"
    total_bits = (len(body) - 3) * 8
    first_free = 257 if block_mode else 256
    table = [bytes([i]) for i in range(256)] + ([b""] if block_mode else [])
    n_bits, base, pos, prev = 9, 0, 0, None
    out = bytearray()

    def skip_group(pos: int, base: int, n_bits: int) -> int:
        group = 8 * n_bits
        return base + -(-(pos - base) // group) * group

    while pos + n_bits <= total_bits:
        if len(table) > (1 << n_bits) - 1 and n_bits < maxbits:
            pos = base = skip_group(pos, base, n_bits)
            n_bits += 1
            continue
        byte = pos >> 3
        code = (int.from_bytes(body[byte : byte + 3], "little") >> (pos & 7)) & ((1 << n_bits) - 1)
        pos += n_bits
        if block_mode and code == 256:
            pos = base = skip_group(pos, base, n_bits)
            del table[first_free:]
            n_bits, prev = 9, None
            continue
        if prev is None:
            entry = table[code]
        elif code < len(table):
            entry = table[code]
            if len(table) < (1 << maxbits):
                table.append(table[prev] + entry[:1])
        elif code == len(table):
            entry = table[prev] + table[prev][:1]
            table.append(entry)
        else:
            raise ValueError(f"corrupt .Z data: code {code} with {len(table)} table entries")
        out += entry
        prev = code
    return bytes(out)


def read_bible_data(path: str) -> str:
    """Decodes bible-kjv's `bible.data`: a header, a table of block offsets, .Z-compressed blocks.

    Layout (big-endian): magic "EC02..." up to byte 0x54, then block size, block count, and
    count + 1 absolute offsets; the blocks share the first block's 3-byte .Z header.
    """
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(b"EC02"):
        raise ValueError(f"{path}: not a bible-kjv data file (magic {data[:4]!r})")
    _, count = struct.unpack_from(">II", data, 0x54)
    offsets = struct.unpack_from(f">{count + 1}I", data, 0x5C)
    header = data[offsets[0] - 3 : offsets[0]]
    blocks = [_unlzw(header + data[offsets[i] : offsets[i + 1]]) for i in range(count)]
    return b"".join(blocks).decode("ascii")


def find_corpus(path: str | None, workdir: str) -> str:
    """Returns the path of `bible.data`, from a .deb, an extracted tree, the file, or apt."""
    if path is None:
        print("downloading bible-kjv-text with apt-get", flush=True)
        _run_tool(["apt-get", "download", "bible-kjv-text"], "fetch the corpus (pass --corpus FILE instead)", workdir)
        path = glob.glob(os.path.join(workdir, "bible-kjv-text_*.deb"))[0]
    if not os.path.exists(path):
        raise InvalidRequestError(f"--corpus {path!r}: no such file or directory")
    if path.endswith(".deb"):
        tree = os.path.join(workdir, "deb")
        _run_tool(["dpkg-deb", "-x", path, tree], f"unpack --corpus {path!r}")
        path = tree
    if os.path.isdir(path):
        found = glob.glob(os.path.join(path, "**", "bible.data"), recursive=True)
        if not found:
            raise InvalidRequestError(f"--corpus: no bible.data under {path!r}")
        path = found[0]
    return path


def _run_tool(command: list[str], purpose: str, cwd: str | None = None) -> None:
    """Runs an external tool; its absence or failure is a one-line error saying what it was for."""
    try:
        subprocess.run(command, cwd=cwd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise InvalidRequestError(f"`{' '.join(command)}` failed ({e}): cannot {purpose}") from None


_VERSE = re.compile(r"^([1-3]?[A-Z][A-Za-z]*)(\d+):(\d+) (.+)$")


def parse_verses(text: str) -> list[tuple[str, str]]:
    """[(book, verse text)] in canonical order; the reference ("Ge1:1") is stripped."""
    verses = []
    for line in text.splitlines()[1:]:  # line 0 is the edition's title
        m = _VERSE.match(line)
        if m:
            verses.append((m.group(1), " ".join(m.group(4).split())))
    return verses


def corpus_words(verses) -> list[str]:
    """The corpus vocabulary: lower-cased alphabetic words (apostrophes kept inside: "lord's")."""
    words = set()
    for _, v in verses:
        words.update(w.strip("'") for w in re.findall(r"[a-z']+", v.lower()))
    return sorted(w for w in words if w)


# ----------------------------------------------------------------------------------------------
# (b) The tokenizer.


def train_tokenizer(sentences: list[str], prefix: str, vocab_size: int):
    import sentencepiece as spm

    try:
        _train_sentencepiece(spm, sentences, prefix, vocab_size)
    except RuntimeError as e:
        if m := re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(e)):
            raise InvalidRequestError(
                f"--vocab-size must be at least {m[2]} for this corpus (its characters, 256 bytes and 3 "
                f"control pieces), got {m[1]}"
            ) from None
        raise
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def _train_sentencepiece(spm, sentences, prefix, vocab_size) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",  # no NFKC, so decode(encode(text)) == text
        remove_extra_whitespaces=False,
        split_digits=True,
        unk_id=0,
        bos_id=BOS,
        eos_id=EOS,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )


def encode_stream(sp, verses) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates the verses' tokens (EOS after each book); returns (tokens, verse start offsets)."""
    ids = sp.encode([v for _, v in verses], out_type=int)
    chunks, starts, n = [], [], 0
    for i, ((book, _), toks) in enumerate(zip(verses, ids)):
        starts.append(n)
        if i + 1 == len(verses) or verses[i + 1][0] != book:
            toks = [*toks, EOS]
        chunks.append(np.asarray(toks, np.int32))
        n += len(toks)
    return np.concatenate(chunks), np.asarray(starts, np.int64)


def heldout_chunks(tokens, starts, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Whole verses packed greedily into BOS-led rows of seq_len + 1; every token is scored once.

    Returns (rows [R, seq_len + 1] int32, mask [R, seq_len] of scored next-token positions).
    """
    bounds = [*starts.tolist(), len(tokens)]
    rows, cur = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        verse = tokens[a:b].tolist()[:seq_len]
        if len(cur) + len(verse) > seq_len:
            rows.append(cur)
            cur = []
        cur = cur + verse
    rows.append(cur)
    out = np.zeros((len(rows), seq_len + 1), np.int32)
    mask = np.zeros((len(rows), seq_len), bool)
    for i, r in enumerate(rows):
        out[i, 0] = BOS
        out[i, 1 : 1 + len(r)] = r
        mask[i, : len(r)] = True
    return out, mask


# ----------------------------------------------------------------------------------------------
# (c) The model and its training forward.


def default_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        name="jaxinfer-kjv-6m",
        family="llama",
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_ids=(EOS,),
    )


def _norm(cfg: ModelConfig, p, x):
    return model.RMSNorm(cfg, x.shape[-1]).apply({"params": p}, x)


def _causal_attention(cfg: ModelConfig, layer: int, p, x, cos, sin):
    """Dense causal attention over the whole sequence with the paged layer's parameters. x: [B, T, D]."""
    b, t, _ = x.shape
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = jnp.einsum("BTD,DNH->BTNH", x, p["wq"])
    kx = jnp.einsum("BTD,DKH->BTKH", x, p["wk"])
    vx = jnp.einsum("BTD,DKH->BTKH", x, p["wv"])
    if cfg.qkv_bias:
        q, kx, vx = q + p["bq"], kx + p["bk"], vx + p["bv"]
    if cfg.qk_norm:
        q, kx = _norm(cfg, p["q_norm"], q), _norm(cfg, p["k_norm"], kx)
    q, kx = model.apply_rope(q, cos, sin), model.apply_rope(kx, cos, sin)
    qg = q.reshape(b, t, k, n // k, h)  # [B, T, K, G, H]
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, kx, preferred_element_type=jnp.float32) * h**-0.5
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]  # [T, S]
    kind = cfg.attention_kind(layer)
    if isinstance(kind, SlidingWindow):
        mask &= pos[:, None] - pos[None, :] < kind.window
    logits = jnp.where(mask, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1).astype(vx.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, vx).reshape(b, t, n * h)
    o = jnp.einsum("BTE,ED->BTD", out, p["wo"].reshape(n * h, -1))
    return o + p["bo"] if cfg.o_bias else o


# Options the paged model implements and this training forward does not (Gemma's): refused, not ignored.
_NOT_IN_TRAINING = (
    "embed_scale",
    "post_norms",
    "query_pre_attn_scalar",
    "attn_logit_softcap",
    "final_logit_softcap",
    "local_rope_theta",
)


def train_logits(params, tokens, *, cfg: ModelConfig):
    """Logits at every position, [B, T, V] float32, for tokens [B, T] starting at position 0."""
    used = [name for name in _NOT_IN_TRAINING if getattr(cfg, name, None)]
    if used:
        raise ValueError(f"train_logits does not implement {used[0]!r}; train a plain Llama-family config")
    x = jnp.take(params["embedding"], tokens, axis=0)  # [B, T, D]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = model.rope_tables(cfg, positions)
    for i in range(cfg.num_layers):
        p = params[f"layer_{i}"]
        x = x + _causal_attention(cfg, i, p["attn"], _norm(cfg, p["attn_norm"], x), cos, sin)
        x = x + model.MLP(cfg).apply({"params": p["mlp"]}, _norm(cfg, p["mlp_norm"], x))
    x = _norm(cfg, params["final_norm"], x)
    if cfg.tie_word_embeddings:
        return jnp.einsum("BTD,VD->BTV", x, params["embedding"], preferred_element_type=jnp.float32)
    return jnp.einsum("BTD,DV->BTV", x, params["lm_head"], preferred_element_type=jnp.float32)


def check_against_prefill(cfg: ModelConfig, params, tokens: np.ndarray) -> float:
    """Max |difference| between `train_logits` and the paged `prefill` at each row's last token.

    tokens: [B, T]; the prefill runs with 16-token pages, its rows laid out on consecutive pages.
    """
    b, t = tokens.shape
    page = 16
    per_row = -(-t // page)
    cache = KVCache.create(cfg, num_pages=1 + b * per_row, page_size=page)
    batch = Batch(
        tokens=jnp.asarray(tokens, jnp.int32),
        q_lens=jnp.full((b,), t, jnp.int32),
        kv_lens=jnp.full((b,), t, jnp.int32),
        page_table=jnp.asarray(1 + np.arange(b * per_row).reshape(b, per_row), jnp.int32),
    )
    paged, _ = model.prefill(params, cache, batch, cfg=cfg)
    dense = train_logits(params, jnp.asarray(tokens), cfg=cfg)[:, -1]
    return float(jnp.max(jnp.abs(paged - dense)))


def _loss(params, rows, mask, cfg):
    logits = train_logits(params, rows[:, :-1], cfg=cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, rows[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll * mask), jnp.sum(mask)


def make_optimizer(args):
    """(learning-rate schedule, optimizer): AdamW with gradients clipped to norm 1; the rate rises
    linearly from 0 to --lr over --warmup steps, then falls on a cosine to a tenth of it at --steps."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=args.warmup, decay_steps=args.steps, end_value=args.lr * 0.1
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay),
    )
    return schedule, optimizer


def make_train_step(cfg: ModelConfig, optimizer):
    def step(params, opt_state, rows):
        def mean_loss(p):
            total, count = _loss(p, rows, jnp.ones(rows[:, 1:].shape, jnp.float32), cfg)
            return total / count

        loss, grads = jax.value_and_grad(mean_loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        import optax

        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def evaluate(cfg: ModelConfig, params, rows, mask, batch_size: int = 32) -> tuple[float, int]:
    """(total NLL in nats, scored tokens) over the rows."""
    fn = jax.jit(lambda p, r, m: _loss(p, r, m, cfg))
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        t, c = fn(params, jnp.asarray(rows[i : i + batch_size]), jnp.asarray(mask[i : i + batch_size], jnp.float32))
        total, count = total + float(t), count + int(c)
    return total, count


# ----------------------------------------------------------------------------------------------
# Driver.


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxinfer.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--corpus", default=None, help="bible-kjv-text .deb, extracted tree, or bible.data")
    ap.add_argument("--workdir", default=None, help="keep intermediate files here (default: a temp dir)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--heldout-frac", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop early (not reproducible) past this")
    ap.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--log-every", type=int, default=20)
    args = ap.parse_args(argv)
    from jaxinfer.cli import run_command  # one-line errors, as every jaxinfer command

    return run_command(_train, args, argv)


def _check_args(args) -> None:
    """Every number in range before anything runs (optax's schedule raised from deep inside for a
    --steps at or below --warmup, after the corpus and tokenizer work)."""

    def need(ok: bool, flag: str, limit: str) -> None:
        if not ok:
            raise InvalidRequestError(f"{flag} must be {limit}, got {getattr(args, flag[2:].replace('-', '_'))!r}")

    need(args.steps >= 1, "--steps", "an integer >= 1")
    need(0 <= args.warmup < args.steps, "--warmup", f"an integer in [0, --steps = {args.steps})")
    need(args.batch_size >= 1, "--batch-size", "an integer >= 1")
    need(args.seq_len >= 2, "--seq-len", "an integer >= 2")
    need(260 <= args.vocab_size <= 65536, "--vocab-size", "an integer in [260, 65536] (256 byte pieces and more)")
    need(math.isfinite(args.lr) and args.lr > 0, "--lr", "a finite number > 0")
    need(math.isfinite(args.weight_decay) and args.weight_decay >= 0, "--weight-decay", "a finite number >= 0")
    need(0 < args.heldout_frac < 1, "--heldout-frac", "a number in (0, 1)")
    need(args.max_minutes is None or args.max_minutes > 0, "--max-minutes", "a number > 0")
    need(args.log_every >= 1, "--log-every", "an integer >= 1")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise InvalidRequestError(f"--out {args.out!r} exists and is not an empty directory")


def _train(args, argv) -> int:
    _check_args(args)
    t_start = time.time()
    workdir = args.workdir or tempfile.mkdtemp(prefix="jaxinfer-train-")
    os.makedirs(workdir, exist_ok=True)
    verses = parse_verses(read_bible_data(find_corpus(args.corpus, workdir)))
    n_held = max(1, math.ceil(len(verses) * args.heldout_frac))
    train_v, held_v = verses[:-n_held], verses[-n_held:]
    print(
        f"corpus: {len(verses)} verses; training {len(train_v)}, held out {len(held_v)} (from {held_v[0][0]} on)",
        flush=True,
    )

    sp = train_tokenizer([v for _, v in train_v], os.path.join(workdir, "tokenizer"), args.vocab_size)
    train_tokens, train_starts = encode_stream(sp, train_v)
    held_tokens, held_starts = encode_stream(sp, held_v)
    print(
        f"tokenizer: {sp.get_piece_size()} pieces; {len(train_tokens)} training tokens "
        f"({len(train_tokens) / sum(len(v.split()) for _, v in train_v):.2f} per word)",
        flush=True,
    )

    cfg = default_config(sp.get_piece_size())
    params = model.init_params(cfg, args.seed)
    print(f"model: {cfg.num_params / 1e6:.2f}M parameters ({cfg})", flush=True)

    schedule, optimizer = make_optimizer(args)
    opt_state = optimizer.init(params)
    step_fn = make_train_step(cfg, optimizer)

    rng = np.random.default_rng(args.seed)
    t = args.seq_len
    valid_starts = train_starts[train_starts + t <= len(train_tokens)]
    window = np.arange(t)
    t_train = time.time()
    steps_done = 0
    for step in range(args.steps):
        starts = rng.choice(valid_starts, size=args.batch_size)
        rows = np.concatenate(
            [np.full((args.batch_size, 1), BOS, np.int32), train_tokens[starts[:, None] + window]], axis=1
        )
        params, opt_state, loss = step_fn(params, opt_state, jnp.asarray(rows))
        steps_done = step + 1
        if step % args.log_every == 0 or steps_done == args.steps:
            elapsed = time.time() - t_train
            print(
                f"step {step:5d}  loss {float(loss):.4f}  lr {float(schedule(step)):.2e}  "
                f"{elapsed:7.1f}s  {steps_done * args.batch_size * t / elapsed:6.0f} tok/s",
                flush=True,
            )
        if args.max_minutes is not None and time.time() - t_start > args.max_minutes * 60:
            print(f"stopping early at step {steps_done}: --max-minutes {args.max_minutes} reached", flush=True)
            break
    train_s = time.time() - t_train
    np.savez(
        os.path.join(workdir, "params_f32.npz"),
        **{"/".join(k.key for k in path): np.asarray(v) for path, v in jax.tree_util.tree_leaves_with_path(params)},
    )

    rows, mask = heldout_chunks(held_tokens, held_starts, t)
    nll, count = evaluate(cfg, params, rows, mask)
    held_words = sum(len(v.split()) for _, v in held_v)
    report = {
        "steps": steps_done,
        "train_seconds": round(train_s, 1),
        "tokens_seen": steps_done * args.batch_size * t,
        "num_params": cfg.num_params,
        "heldout_verses": len(held_v),
        "heldout_tokens": count,
        "heldout_token_perplexity": round(math.exp(nll / count), 3),
        "heldout_word_perplexity": round(math.exp(nll / held_words), 3),
    }
    print(f"held-out: {json.dumps(report)}", flush=True)

    # The two forwards agree (float32, before any rounding for storage).
    diff = check_against_prefill(cfg, params, rows[:4, :64])
    print(f"max |train_logits - prefill| at the last token: {diff:.2e}", flush=True)
    if diff > 1e-3:
        raise SystemExit("training forward and prefill disagree")

    from jaxinfer import checkpoint

    extras = {
        "tokenizer.model": os.path.join(workdir, "tokenizer.model"),
    }
    checkpoint.save(
        args.out,
        cfg,
        params,
        dtype=args.save_dtype,
        tokenizer_files=list(extras.values()),
        tokenizer_config={"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"},
    )
    with gzip.open(os.path.join(args.out, "corpus_words.txt.gz"), "wt", compresslevel=9) as f:
        f.write("\n".join(corpus_words(verses)) + "\n")
    report["total_seconds"] = round(time.time() - t_start, 1)
    report["command"] = " ".join(["python -m jaxinfer.train", *(argv if argv is not None else sys.argv[1:])])
    report["args"] = vars(args)
    with open(os.path.join(args.out, "training_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"wrote {args.out} in {report['total_seconds']}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
