"""jaxinfer's own checkpoint format: the parameter pytree in orbax, the ModelConfig, the tokenizer.

A checkpoint directory holds

    jaxinfer_checkpoint.json   marker: format name and version, the stored parameter dtype
    config.json                the ModelConfig, losslessly (`config_to_dict` / `config_from_dict`)
    params/                    the parameter pytree, written by orbax's StandardCheckpointer
    tokenizer.*                the tokenizer files, copied as they were (tokenizer.json, tokenizer.model,
                               tokenizer_config.json, ...), so `load_tokenizer` reads them as usual

Loading one skips the Hugging Face name mapping and layout conversion altogether: `restore` hands
orbax abstract arrays that carry the target dtype and sharding, so each array is read straight onto
its devices. Before that, the stored tree is checked against the config, so a missing or misshapen
tensor is reported by name instead of from deep inside tensorstore.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import config as config_module
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.model import abstract_params
from jaxinfer.tokenizer import CHAT_TEMPLATE_DIR, require_unicode

MARKER = "jaxinfer_checkpoint.json"
FORMAT = "jaxinfer-orbax"
VERSION = 1
PARAMS_DIR = "params"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",  # where transformers 5 writes the chat template (named others: CHAT_TEMPLATE_DIR)
    "chat_template.json",
    "generation_config.json",  # not the tokenizer's, but read beside it: EOS ids and default sampling
)

# ----------------------------------------------------------------------------------------------
# ModelConfig <-> JSON.


def _variant_types() -> dict[str, type]:
    """The dataclasses of jaxinfer.config that may appear inside a ModelConfig (RoPE scalings,
    attention kinds), by class name."""
    return {
        name: obj
        for name, obj in vars(config_module).items()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj is not ModelConfig
    }


def _encode(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "type": type(value).__name__,
            **{f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    return value


def _decode(value, where: str):
    if isinstance(value, list):
        return tuple(_decode(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, dict):
        kinds = _variant_types()
        kind = value.get("type")
        if kind not in kinds:
            raise CheckpointError(f"{where}: unknown type {kind!r} (known: {', '.join(sorted(kinds))})")
        fields = {k: _decode(v, f"{where}.{k}") for k, v in value.items() if k != "type"}
        try:
            return kinds[kind](**fields)
        except TypeError as e:
            raise CheckpointError(f"{where}: bad fields for {kind}: {e}") from None
    return value


def config_to_dict(cfg: ModelConfig) -> dict:
    """Every field of the config, as JSON-ready values; variants as {"type": ClassName, ...}."""
    return {f.name: _encode(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def config_from_dict(d: dict, *, source: str = "config") -> ModelConfig:
    """Inverse of `config_to_dict`; JSON lists come back as tuples (configs stay hashable).

    Raises:
        CheckpointError: naming the unknown field or malformed value.
    """
    if not isinstance(d, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CheckpointError(f"{source}: unknown field {unknown[0]!r} (written by a newer jaxinfer?)")
    values = {k: _decode(v, f"{source}: {k}") for k, v in d.items()}
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as e:  # ModelConfig's own errors are ValueErrors too
        raise CheckpointError(f"{source}: {e}") from None


# ----------------------------------------------------------------------------------------------
# Save / restore.


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True when `path` is a jaxinfer checkpoint directory (it has the marker file)."""
    return os.path.isfile(os.path.join(os.fspath(path), MARKER))


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def _leaf_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _check_out_dir(out_dir: str | os.PathLike) -> str:
    """The absolute path of an output directory that is new or empty; else CheckpointError."""
    if not os.fspath(out_dir):  # abspath("") is the working directory
        raise CheckpointError("the output directory must be a path, got an empty string")
    out_dir = os.path.abspath(os.fspath(out_dir))
    require_unicode(out_dir, "the output directory")  # (undecodable bytes in argv): orbax takes UTF-8 paths only
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"output directory {out_dir!r} is a file")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"output directory {out_dir!r} exists and is not empty")
    parent = os.path.dirname(out_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"output directory {out_dir!r} cannot be created: {parent!r} is not a writable directory")
    return out_dir


def save(
    out_dir: str | os.PathLike,
    cfg: ModelConfig,
    params,
    *,
    dtype: str | None = None,
    tokenizer_dir: str | None = None,
    tokenizer_files: list[str] = (),
    tokenizer_config: dict | None = None,
) -> None:
    """Writes a checkpoint directory (see the module docstring).

    Args:
        out_dir: must not exist, or be empty.
        cfg: the model config; stored with `dtype` as its dtype.
        params: the parameter pytree (any sharding).
        dtype: storage dtype of the parameters ("float32" | "bfloat16"); default cfg.dtype.
        tokenizer_dir: copy the tokenizer files (TOKENIZER_FILES) found in this directory.
        tokenizer_files: further files to copy beside the parameters.
        tokenizer_config: written as tokenizer_config.json (after the copies).
    """
    out_dir = _check_out_dir(out_dir)
    dtype = dtype or cfg.dtype
    if dtype not in config_module.DTYPES:
        raise CheckpointError(f"dtype must be one of {config_module.DTYPES}, got {dtype!r}")
    created = not os.path.exists(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create output directory {out_dir!r}: {e.strerror or e}") from None
    try:
        _write(out_dir, cfg, params, dtype, tokenizer_dir, tokenizer_files, tokenizer_config)
    except BaseException:  # (Ctrl-C too) no half-written checkpoint left behind: the directory was new or empty
        shutil.rmtree(out_dir, ignore_errors=True)
        if not created:
            os.makedirs(out_dir, exist_ok=True)
        raise


def _write(out_dir, cfg, params, dtype, tokenizer_dir, tokenizer_files, tokenizer_config) -> None:
    if cfg.weight_strips:  # an LLM's params (see jaxinfer.llm): written in the declared layout
        from jaxinfer.model import from_weight_strips

        params, cfg = from_weight_strips(params, cfg.weight_strips), dataclasses.replace(cfg, weight_strips=0)
    stored = jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), params)
    with _checkpointer() as ckpt:
        ckpt.save(os.path.join(out_dir, PARAMS_DIR), stored)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_to_dict(dataclasses.replace(cfg, dtype=dtype)), f, indent=1)
    files = list(tokenizer_files)
    if tokenizer_dir is not None:
        files += [
            os.path.join(tokenizer_dir, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, n))
        ]
    for src in files:
        shutil.copyfile(src, os.path.join(out_dir, os.path.basename(src)))
    named = os.path.join(tokenizer_dir, CHAT_TEMPLATE_DIR) if tokenizer_dir is not None else None
    if named is not None and os.path.isdir(named):  # transformers 5's named chat templates, NAME.jinja each
        os.makedirs(os.path.join(out_dir, CHAT_TEMPLATE_DIR))
        for name in os.listdir(named):
            if name.endswith(".jinja") and os.path.isfile(os.path.join(named, name)):
                shutil.copyfile(os.path.join(named, name), os.path.join(out_dir, CHAT_TEMPLATE_DIR, name))
    if tokenizer_config is not None:
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f, indent=1)
    # The marker last: a directory with it is complete.
    with open(os.path.join(out_dir, MARKER), "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, "params": PARAMS_DIR, "dtype": dtype}, f, indent=1)


def load_config(ckpt_dir: str, *, dtype: str | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (dtype overridden when given)."""
    if not os.path.isdir(ckpt_dir):
        what = "is a file, not a directory" if os.path.exists(ckpt_dir) else "does not exist"
        raise CheckpointError(f"checkpoint directory {ckpt_dir!r} {what}")
    marker = os.path.join(ckpt_dir, MARKER)
    try:
        with open(marker, encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir!r} is not a jaxinfer checkpoint (no {MARKER})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{marker} is corrupt: {e}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or info.get("version") != VERSION:
        raise CheckpointError(f"{marker}: expected format {FORMAT!r} version {VERSION}, got {info!r}")
    path = os.path.join(ckpt_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt_dir!r} has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from None
    cfg = config_from_dict(d, source=path)
    return dataclasses.replace(cfg, dtype=dtype) if dtype is not None else cfg


def _stored_tree(params_dir: str) -> dict:
    """{tensor name: (shape, dtype)} from the orbax metadata, without reading any array."""
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"checkpoint is missing its parameter directory {params_dir!r}")
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # "Failed to get item metadata ...": said below, as an error
    try:
        with _OrbaxLeftovers.reading(), _checkpointer() as ckpt:
            meta = ckpt.metadata(params_dir)
            item = getattr(meta, "item_metadata", meta)
            tree = getattr(item, "tree", item)
            if not isinstance(tree, dict):  # orbax logs a warning and returns no tree for unreadable metadata
                why = "corrupt or incomplete checkpoint"
                raise CheckpointError(f"{params_dir}: cannot read the orbax metadata ({why})")
    except CheckpointError:
        raise
    except Exception as e:  # orbax raises assorted types for unreadable metadata
        raise CheckpointError(f"{params_dir}: cannot read the orbax metadata ({type(e).__name__}: {e})") from None
    finally:
        absl.setLevel(level)
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return {_leaf_name(p): (tuple(x.shape), x.dtype) for p, x in leaves}


_ORBAX = f"{os.sep}orbax{os.sep}"  # in a file path: a module of the orbax package


def _from_orbax(tb) -> bool:
    return any(_ORBAX in frame.filename for frame in traceback.extract_tb(tb))


class _OrbaxLeftovers(logging.Filter):
    """When a read fails, orbax abandons its other reads on an event loop it then closes; their
    coroutines, futures and callbacks, collected later (at exit at the latest), each printed a
    traceback with a dump of TensorStore's spec ("Exception ignored in: <coroutine ...>", "exception
    was never retrieved", "Event loop is closed") under the one-line CheckpointError. `reading()`,
    around every orbax read, installs a hook for unraisable exceptions and this filter on asyncio's
    logger, which drop those: exceptions raised in orbax's code, and - only while orbax reads or
    after a read has failed - the bare "Event loop is closed" of a completion callback calling into
    orbax's closed loop. (The abandoned reads' callbacks run on TensorStore's threads and can beat
    the failure out of orbax, so "while orbax reads" counts too.)"""

    read_failed = False
    active = 0  # orbax reads in progress

    @classmethod
    def _suspect(cls) -> bool:
        return cls.read_failed or cls.active > 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info
        if not ("never retrieved" in str(record.msg) and exc):
            return True
        from_orbax = exc[2] is not None and _from_orbax(exc[2])
        return not (from_orbax or (self._suspect() and "tensorstore_spec" in str(exc[1])))

    @classmethod
    def drops(cls, unraisable) -> bool:
        code = getattr(unraisable.object, "cr_code", None)
        if (code is not None and _ORBAX in code.co_filename) or _from_orbax(unraisable.exc_traceback):
            return True
        closed = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
        return cls._suspect() and closed and unraisable.object is None

    @classmethod
    def install(cls) -> None:
        previous = sys.unraisablehook
        if getattr(previous, "drops_orbax_leftovers", False):
            return

        def hook(unraisable):
            if not cls.drops(unraisable):
                previous(unraisable)

        hook.drops_orbax_leftovers = True
        sys.unraisablehook = hook
        asyncio_log = logging.getLogger("asyncio")
        if not any(isinstance(f, cls) for f in asyncio_log.filters):
            asyncio_log.addFilter(cls())

    @classmethod
    @contextlib.contextmanager
    def reading(cls):
        """Around one orbax read: a read that raises marks the process as having left reads behind."""
        cls.install()
        cls.active += 1
        try:
            yield
        except BaseException:
            cls.read_failed = True
            raise
        finally:
            cls.active -= 1


def restore(ckpt_dir: str | os.PathLike, *, dtype: str = "float32", shardings=None):
    """Returns (ModelConfig, params) from a checkpoint directory, arrays already on their devices.

    Args:
        ckpt_dir: a directory written by `save`.
        dtype: parameter and compute dtype to restore in (converted from the stored dtype).
        shardings: optional pytree of `jax.sharding.Sharding` matching the parameter tree, one
            Sharding for every array, or a function of the ModelConfig returning either; default:
            the first device.

    Raises:
        CheckpointError: naming the missing file, the missing/unexpected/misshapen tensor, or the
            unreadable data.
    """
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    cfg = load_config(ckpt_dir, dtype=dtype)
    params_dir = os.path.join(ckpt_dir, PARAMS_DIR)
    stored = _stored_tree(params_dir)
    abstract = abstract_params(cfg)
    if callable(shardings) and not isinstance(shardings, jax.sharding.Sharding):
        shardings = shardings(cfg)
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, abstract)
    if jax.tree.structure(shardings) != jax.tree.structure(abstract):
        raise ValueError(
            f"shardings: a tree of {len(jax.tree.leaves(shardings))} shardings, the {cfg.name} parameters are "
            f"{len(jax.tree.leaves(abstract))} arrays in another structure: give one sharding per parameter "
            "(e.g. `lambda cfg: sharding.param_shardings(cfg, mesh)`), one sharding for all, or None"
        )
    want = {}
    for (path, x), sharding in zip(jax.tree_util.tree_leaves_with_path(abstract), jax.tree.leaves(shardings)):
        want[_leaf_name(path)] = (x.shape, sharding)
    for name, (shape, _) in want.items():
        if name not in stored:
            raise CheckpointError(f"{params_dir}: missing tensor {name!r} (expected shape {shape})")
        if stored[name][0] != shape:
            raise CheckpointError(
                f"{params_dir}: tensor {name!r} has shape {stored[name][0]}, the config needs {shape}: wrong shape"
            )
    extra = sorted(set(stored) - set(want))
    if extra:
        raise CheckpointError(
            f"{params_dir}: unexpected tensor {extra[0]!r} ({len(extra)} in all); the config may not match the weights"
        )
    target = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=want[_leaf_name(p)][1]), abstract
    )
    try:
        with _OrbaxLeftovers.reading(), _checkpointer() as ckpt:
            params = ckpt.restore(params_dir, target)
    except Exception as e:  # tensorstore/orbax errors: corrupt or truncated array data
        while e.__cause__ is not None:  # orbax wraps TensorStore's one-line reason in a dump of its spec
            e = e.__cause__
        reason = (str(e).strip().splitlines() or [""])[0][:400]
        raise CheckpointError(f"{params_dir}: cannot read the parameters ({type(e).__name__}: {reason})") from None
    _check_finite(params, params_dir)
    return cfg, params


@jax.jit
def _nonfinite_counts(leaves: list[jax.Array]) -> list[jax.Array]:
    return [jnp.count_nonzero(~jnp.isfinite(x)) for x in leaves]


def _check_finite(params, params_dir: str) -> None:
    """Every restored value must be finite, as for Hugging Face checkpoints (loading.count_nonfinite):
    one NaN in a weight makes every logit NaN. In one process on the CPU the arrays are host memory,
    read in place (the default model: ~2 ms); elsewhere counted on their devices by one program, which
    every process of a multi-host job runs (a tensor split over processes by a collective, so all of
    them see its count; one each holds whole is counted by each)."""
    from jaxinfer.loading import count_nonfinite

    named = jax.tree_util.tree_leaves_with_path(params)
    leaves = [x for _, x in named]
    if jax.process_count() == 1 and all(d.platform == "cpu" for x in leaves for d in x.devices()):
        # No program to compile for it (~0.5 s, on every start of the default model).
        counts = [
            sum(count_nonfinite(np.asarray(s.data)) for s in x.addressable_shards if s.replica_id == 0) for x in leaves
        ]
    else:
        counts = jax.device_get(_nonfinite_counts(leaves))
    for (path, _), count in zip(named, counts):
        if count:
            raise CheckpointError(
                f"{params_dir}: tensor {_leaf_name(path)!r} holds {int(count)} NaN or infinite "
                f"value{'s' if count > 1 else ''}: the checkpoint's weights are broken (a diverged "
                "training run, a bad merge or conversion?)"
            )


# ----------------------------------------------------------------------------------------------
# Conversion and load-time measurement.


def convert_hf(hf_dir: str, out_dir: str, *, dtype: str = "auto") -> ModelConfig:
    """Hugging Face safetensors checkpoint -> jaxinfer checkpoint (parameters stored in `dtype`).

    dtype="auto": the dtype `LLM(hf_dir, dtype="auto")` computes in (`loading.auto_dtype`), so the copy behaves as
    the original does (a bfloat16 checkpoint is not widened to float32). The returned config's dtype
    is the one stored."""
    from jaxinfer.loading import auto_dtype, load_hf_checkpoint
    from jaxinfer.tokenizer import load_tokenizer

    _check_out_dir(out_dir)  # before the load, which a large model spends minutes on
    if dtype == "auto":
        dtype = auto_dtype(hf_dir)
    cfg, params = load_hf_checkpoint(hf_dir, dtype=dtype)
    # Like LLM does: the tokenizer's own EOS joins the config's, so the checkpoint stands alone.
    tok = load_tokenizer(hf_dir, eos_ids=cfg.eos_token_ids)
    if tok is not None and tok.eos_ids != cfg.eos_token_ids:
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(tok.eos_ids))
    save(out_dir, cfg, params, dtype=dtype, tokenizer_dir=hf_dir)
    return cfg


def _block(params) -> None:
    jax.block_until_ready(jax.tree.leaves(params))


def bench_load(hf_dir: str, *, dtype: str = "float32", repeats: int = 3, orbax_dir: str | None = None) -> dict:
    """Times loading one model from its HF safetensors and from its jaxinfer (orbax) checkpoint.

    The orbax copy is converted into a temp dir unless `orbax_dir` is given. Each format is loaded
    `repeats` times, alternating, arrays on device and ready; the first load of each also pays for
    cold files, so the median is the figure to compare.

    Returns:
        {"params": n, "bytes": b, "hf_s": [...], "orbax_s": [...], "hf_median_s", "orbax_median_s"}.
    """
    from jaxinfer.loading import load_hf_checkpoint

    tmp = None
    try:
        if orbax_dir is None:  # (inside the try: a failed or interrupted conversion leaves no temp dir)
            tmp = tempfile.mkdtemp(prefix="jaxinfer-bench-load-")
            orbax_dir = os.path.join(tmp, "ckpt")
            convert_hf(hf_dir, orbax_dir, dtype=dtype)
        hf_s, orbax_s = [], []
        nbytes = n = 0
        for _ in range(repeats):
            t = time.perf_counter()
            _, params = load_hf_checkpoint(hf_dir, dtype=dtype)
            _block(params)
            hf_s.append(time.perf_counter() - t)
            shapes = jax.tree.map(lambda x: x.shape, params)
            del params
            t = time.perf_counter()
            _, params = restore(orbax_dir, dtype=dtype)
            _block(params)
            orbax_s.append(time.perf_counter() - t)
            if jax.tree.map(lambda x: x.shape, params) != shapes:
                raise CheckpointError(
                    f"{orbax_dir!r} holds another model than {hf_dir!r} (its tensors differ in names or shapes): "
                    "give a `jaxinfer convert` output of the same checkpoint"
                )
            n = sum(x.size for x in jax.tree.leaves(params))
            nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
            del params
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "params": int(n),
        "bytes": int(nbytes),
        "dtype": dtype,
        "hf_s": [round(s, 3) for s in hf_s],
        "orbax_s": [round(s, 3) for s in orbax_s],
        "hf_median_s": round(float(np.median(hf_s)), 3),
        "orbax_median_s": round(float(np.median(orbax_s)), 3),
    }
