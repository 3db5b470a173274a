"""What a checkpoint must share with the run that resumes from it: the data (``checkpoint.resume =
auto``), the model's shape and the dense optimizer. Each check is a ``ValueError`` naming the key
and both values, raised on every rank alike before any row is loaded. Local."""

from pathlib import Path

from ..config import Config

__all__ = ["check_same_data", "check_same_model", "check_same_dense_optimizer", "SAME_DATA", "MODEL_KEYS"]

SAME_DATA = ("format", "path", "eval_path", "eval_fraction", "label")


def _data_key(data: dict, key: str):
    """A data key as compared across runs: file lists as resolved paths. Local."""
    v = data.get(key)
    if key in ("path", "eval_path") and v:
        return [str(Path(p).resolve()) for p in str(v).split(",")]
    return v


def check_same_data(cfg: Config, manifest: dict, path) -> None:
    """``checkpoint.resume = "auto"`` goes on only with the data the checkpoint was trained on:
    a ``ValueError`` naming the first key that differs (data.format, path, eval_path,
    eval_fraction, label), before any row is loaded. A run pointed at a new file with an old
    ``checkpoint.dir`` would otherwise go on from (or, stopped early, only evaluate) the old
    model. A checkpoint's path in ``checkpoint.resume`` is taken as asked. Local."""
    saved = manifest.get("config", {}).get("data")
    if saved is None:
        return
    now = cfg.to_dict()["data"]
    for key in SAME_DATA:
        if _data_key(saved, key) != _data_key(now, key):
            raise ValueError(f"checkpoint.resume = auto: {path} was trained with data.{key} = {saved.get(key)!r}, "
                             f"this run has {now.get(key)!r}: use another checkpoint.dir to train afresh, or "
                             f"checkpoint.resume = {path} to go on from it anyway")


MODEL_KEYS = ("kind", "dynamic_tables", "dim", "bottom_mlp", "top_mlp", "cross_layers")   # the model's shape


def check_same_model(cfg: Config, manifest: dict, path) -> None:
    """A checkpoint holds one model: another ``model.kind``, dim, MLP or cross layers is a
    ``ValueError`` naming the first key that differs (the kind before the layers it implies), before
    any row is loaded; a kind whose tables happen to fit would otherwise go on from rows trained
    for another model. Local."""
    saved = manifest.get("config", {}).get("model")
    if not saved:
        return
    for key in MODEL_KEYS:
        have, want = getattr(cfg.model, key, None), saved.get(key)
        if want is not None and have != want:
            raise ValueError(f"{path} holds a model with model.{key} = {want!r}, this run has {have!r}: set it back "
                             f"to go on from it, or train afresh with another checkpoint.dir (or checkpoint.resume = none)")


def check_same_dense_optimizer(cfg: Config, manifest: dict, path) -> None:
    """A checkpoint's dense optimizer state fits only the optimizer that wrote it: another
    ``optimizer.dense.name``, or ``optimizer.dense.linear_lr`` set on one side only (one param group
    or two), is a ``ValueError`` naming both, before any row is loaded. Local."""
    saved = manifest.get("config", {}).get("optimizer", {}).get("dense", {}).get("name")
    if saved is not None and saved != cfg.optimizer.dense.name:
        raise ValueError(f"{path} was trained with optimizer.dense.name = {saved!r}, this run has "
                         f"{cfg.optimizer.dense.name!r}: its dense optimizer state fits only {saved!r} (set it back, "
                         f"or train afresh with checkpoint.resume = none and another checkpoint.dir)")
    theirs = manifest.get("config", {}).get("optimizer", {}).get("dense", {}).get("linear_lr", 0.0)
    if bool(theirs) != bool(cfg.optimizer.dense.linear_lr):        # one param group or two
        raise ValueError(f"{path} was trained with optimizer.dense.linear_lr = {theirs}, this run has "
                         f"{cfg.optimizer.dense.linear_lr}: its dense optimizer state has "
                         f"{'two param groups' if theirs else 'one param group'} (set a linear_lr on both sides or "
                         f"neither, or train afresh with checkpoint.resume = none and another checkpoint.dir)")
