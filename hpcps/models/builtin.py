"""The built-in model kinds, registered without importing torch: each names its module's builder
(``"module:function"``), imported when a worker builds the model (``ModelKind.make``). A PS rank
reads only a kind's parts and tables. Local, pure."""

from .registry import ModelKind, register


def mf_tables(cfg, data) -> list:
    """MF's tables: users' and items' factors (``model.init`` auto: normal, std 0.1) and their
    biases (zeros). Local."""
    dim, kind, scale = cfg.model.dim, cfg.model.init, cfg.model.init_scale or 0.1
    (_, nu), (_, ni) = data.tables
    kind = "normal" if kind == "auto" else kind
    return [("users", nu, dim, kind, scale), ("items", ni, dim, kind, scale), ("user_bias", nu, 1, "zeros", 0.0),
            ("item_bias", ni, 1, "zeros", 0.0)]


register(ModelKind("dlrm", "ctr", ("deep",), "hpcps.models.dlrm:build"))
register(ModelKind("dcn", "ctr", ("deep",), "hpcps.models.dcn:build"))
register(ModelKind("lr", "ctr", ("wide",), "hpcps.models.linear:build", mlps=False))
register(ModelKind("wide_deep", "ctr", ("deep", "wide"), "hpcps.models.wide_deep:build"))
register(ModelKind("deepfm", "ctr", ("deep", "wide"), "hpcps.models.wide_deep:build_deepfm"))
register(ModelKind("mf", "ratings", (), "hpcps.models.mf:build", mlps=False, tables=mf_tables))
