"""The one line a person reads at the end of ``hpcps train``, before the JSON line: the metric,
the steps, the speed, where the model and the checkpoints went. Local, pure."""

__all__ = ["human_summary"]


def _metric(final: dict) -> str:
    for key, name in (("auc", "AUC"), ("rmse", "RMSE")):
        if final.get(key) is not None:
            out = f"eval {name} {final[key]:.4f}"
            planted = final.get(f"planted_{key}")
            return out + (f" (planted model {planted:.4f})" if planted is not None else "")
    return "no evaluation (nothing held out)"


def _recoveries(records: list) -> list:
    """What live failover and rebalancing did (``hpcps.train.failover``'s records), in words."""
    said = []
    for r in records:
        if "lost_ranks" in r:
            said.append(f"lost launch rank{'s' * (len(r['lost_ranks']) > 1)} {', '.join(map(str, r['lost_ranks']))} "
                        f"and went on live from step {r.get('from_step', '?')} ({r.get('steps_redone', 0)} steps, "
                        f"{r.get('pushes_redone', 0)} pushes done again, {r.get('updates_lost', 0)} updates lost)")
        elif "rebalanced_to_num_ps" in r:
            said.append(f"rebalanced to {r['rebalanced_to_num_ps']} PS at step {r.get('from_step', '?')}")
    return said


def human_summary(final: dict, cfg) -> str:
    """``final`` (the final line's fields) and the job's config as one line. Local."""
    steps, start = final.get("steps", 0), final.get("start_step", 0)
    said = [f"steps {start}-{steps}" if start else f"{steps} steps"]
    if steps > start:
        said[0] += f" in {final.get('elapsed_s', 0):.1f} s ({final.get('samples_per_s', 0):,.0f} samples/s)"
    else:
        said[0] += " (nothing left to train)"
    said.append(_metric(final))
    best = final.get("best") or {}
    if final.get("restored_best") is not None:
        said.append(f"the model is the best evaluation's, step {final['restored_best']}")
    elif best.get("step") is not None and best["step"] != steps:
        said.append(f"best evaluation at step {best['step']}")
    if final.get("early_stopped"):
        said.append("stopped early")
    said += _recoveries(final.get("recoveries") or [])
    if final.get("stopped"):
        said.append("stopped on request" + (", checkpointed" if final.get("saved") else ", not saved"))
    exported = final.get("exported") or {}
    if exported.get("path"):
        said.append(f"model: {exported['path']} (step {exported['step']})")
    if cfg.checkpoint.dir and final.get("checkpoints"):
        said.append(f"checkpoints: {cfg.checkpoint.dir} (last step {final['checkpoints'][-1]})")
    if cfg.metrics.path:
        said.append(f"metrics: {cfg.metrics.path}")
    return "hpcps: done: " + "; ".join(said)
