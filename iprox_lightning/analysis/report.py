"""``train.py report``'s work (:func:`run_report`): the retention table of every proxy's score table against the
target's, the FLOPs columns from the models' shapes, SA / 1-NND of each selection from a reference model's projected
gradients, the plots, and ``report.md`` + ``report.json``. ``commands/report.py`` holds the command's arguments."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data import SFTDataModule
from ..errors import UserInputError
from ..io.atomic import write_text_atomic
from ..io.ownership import make_owned_dir
from ..io.scores import read_scores
from ..models.loading import load_model
from .flops import ModelShape
from .plots import plot_score_histograms, plot_score_scatter
from .report_doc import discover_workdir, manifest_sizes, render_markdown
from .subspace import per_example_gradients
from .tables import flops_rows, merge_rows, retention_rows, select_top, selection_rows, write_rows


@dataclass(frozen=True)
class ReportSettings:
    """The arguments of one ``python train.py report``, as :func:`iprox_lightning.commands.report.report` received
    them (its signature declares their defaults, its docstring what each means)."""

    workdir: str | None
    target_scores: str | None
    proxy_scores: dict[str, str] | None
    output_dir: str | None
    target_model: str | None
    proxy_models: dict[str, str] | None
    topk_fraction: float
    seq_len: int
    n_probe_examples: int | None
    n_align_examples: int | None
    n_val: int | None
    gradient_model: str | None
    pool: str
    validation: str
    tokenizer: str | None
    max_length: int
    projection_dim: int
    max_examples: int | None
    plots: bool


def run_report(r: ReportSettings) -> list[dict[str, Any]]:
    """Write ``report.md``, ``report.json`` and the plots of ``r`` under its output directory; returns the rows."""
    src = _report_inputs(r.workdir, r.target_scores, r.proxy_scores, r.target_model, r.proxy_models, r.gradient_model)
    out = Path(r.output_dir or (Path(r.workdir) / "report" if r.workdir else "outputs/report"))
    make_owned_dir(out, "report")
    n_probe_examples, n_align_examples, n_val = _flops_sizes(src.proxy_models, r.n_probe_examples,
                                                             r.n_align_examples, r.n_val, r.pool, r.validation)
    target = read_scores(src.target_scores)
    proxies = {name: read_scores(p) for name, p in src.proxy_scores.items()}
    tables = [retention_rows(target, proxies)]
    if src.target_model and src.proxy_models:
        tables.append(_flops_table(src.target_model, src.proxy_models, seq_len=r.seq_len, n_train=len(target),
                                   n_val=n_val, n_probe_examples=n_probe_examples, n_align_examples=n_align_examples))
    if src.gradient_model:
        tables.append(_selection_table(src.gradient_model, target, proxies, r.topk_fraction, r.max_examples,
                                       r.projection_dim, pool=r.pool, validation=r.validation, tokenizer=r.tokenizer,
                                       max_length=r.max_length))
    rows = _whole_counts(merge_rows(*tables))
    write_rows(rows, out / "report.json")
    pngs = _write_plots(out, target, proxies, r.topk_fraction) if r.plots else []
    settings = {"workdir": r.workdir, "target_scores": src.target_scores, "proxy_scores": src.proxy_scores,
                "target_model": src.target_model, "proxy_models": src.proxy_models,
                "gradient_model (SA, 1-NND)": src.gradient_model, "top-k for SA / 1-NND": r.topk_fraction,
                "FLOPs model": f"seq_len {r.seq_len}, pool {len(target)}, validation {n_val}, "
                f"probe examples {n_probe_examples}, alignment examples {n_align_examples}"}
    _write_markdown(out, rows, settings, pngs, src.found, r.plots)
    return rows


@dataclass(frozen=True)
class _Inputs:
    """The report's score tables and models: as passed, else as found in ``--workdir`` (``found``:
    :func:`~iprox_lightning.analysis.report_doc.discover_workdir`'s result, ``{}`` without a workdir)."""

    target_scores: str
    proxy_scores: dict[str, str]
    target_model: str | None
    proxy_models: dict[str, str] | None
    gradient_model: str | None
    found: dict[str, Any]


def _report_inputs(workdir, target_scores, proxy_scores, target_model, proxy_models, gradient_model) -> _Inputs:
    """Fill in what was not passed from ``workdir``; refuse a report without the target's and the proxies' scores."""
    found: dict[str, Any] = {}
    if workdir:
        found = discover_workdir(workdir)
        target_scores = target_scores or found["target_scores"]
        proxy_scores = proxy_scores or found["proxy_scores"]
        target_model = target_model or found.get("target_model")
        proxy_models = proxy_models or found.get("proxy_models")
        gradient_model = gradient_model or found.get("target_model")
    if not target_scores or not proxy_scores:
        raise UserInputError("report: pass --workdir (a pipeline run) or both --target_scores and --proxy_scores")
    return _Inputs(target_scores, proxy_scores, target_model, proxy_models, gradient_model, found)


def _flops_sizes(proxy_models, n_probe_examples, n_align_examples, n_val, pool, validation) -> tuple[int, int, int]:
    """The FLOPs model's example counts not passed: probe and alignment examples from the first proxy manifest that
    has them (else 0), validation examples from the validation sets."""
    if n_probe_examples is None or n_align_examples is None:
        sizes = next((manifest_sizes(p) for p in (proxy_models or {}).values() if manifest_sizes(p)), {})
        n_probe_examples = sizes.get("n_probe_examples", 0) if n_probe_examples is None else n_probe_examples
        n_align_examples = sizes.get("n_align_examples", 0) if n_align_examples is None else n_align_examples
    if n_val is None:
        n_val = len(SFTDataModule(pool=pool, validation=validation, tokenizer="builtin").validation_records)
    return n_probe_examples, n_align_examples, n_val


def _flops_table(target_model: str, proxy_models: dict[str, str], **sizes) -> list[dict[str, Any]]:
    """The FLOPs columns from the models' shapes, and the cost row of scoring with the target itself."""

    def shape(path: str) -> ModelShape:
        model, _ = load_model(path, tokenizer=False)
        return ModelShape.from_model(model)

    tshape = shape(target_model)
    pshapes = {name: shape(p) for name, p in proxy_models.items()}
    pshapes["target"] = None  # the cost row of scoring with the target itself
    return flops_rows(tshape, pshapes, **sizes)


def _selection_table(gradient_model: str, target, proxies: dict, topk_fraction: float, max_examples: int | None,
                     projection_dim: int, *, pool, validation, tokenizer, max_length: int) -> list[dict[str, Any]]:
    """SA / 1-NND of each selection (the top ``topk_fraction`` of each score table) from ``gradient_model``'s
    randomly projected per-example gradients."""

    dm = SFTDataModule(pool=pool, validation=validation, tokenizer=tokenizer or gradient_model, max_length=max_length)
    dm.setup("predict")
    model, _ = load_model(gradient_model, tokenizer=False)
    # gradients of the selected examples only (their union), not of the whole pool
    wanted = {"target": select_top(target, topk_fraction), **{n: select_top(s, topk_fraction) for n, s in proxies.items()}}
    union = sorted({i for ids in wanted.values() for i in ids})[: max_examples or None]
    by_id = {r["id"]: r for r in dm.pool_records}
    pool_ids, G = per_example_gradients(model, dm.records_dataloader([by_id[i] for i in union if i in by_id]),
                                        projection_dim=projection_dim)
    _, V = per_example_gradients(model, dm.validation_dataloader(), projection_dim=projection_dim)
    present = set(pool_ids)
    selections = {n: [i for i in ids if i in present] for n, ids in wanted.items()}
    return selection_rows(selections, pool_ids, G, V)


def _whole_counts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows, with counts as integers, not 2000.000."""
    for r in rows:
        for c in ("n", "n_selected", "params_tracked"):
            if isinstance(r.get(c), float) and r[c] == int(r[c]):
                r[c] = int(r[c])
    return rows


def _write_plots(out: Path, target, proxies: dict, topk_fraction: float) -> list[Path]:
    """A scatter of each proxy's scores against the target's, and one histogram of every table: the PNGs written."""

    pngs = []
    for name, s in proxies.items():
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        plot_score_scatter(s, target, frac=topk_fraction, path=out / f"scatter_{safe}.png")
        pngs.append(out / f"scatter_{safe}.png")
    plot_score_histograms({"target": target, **proxies}, standardize=True, path=out / "histograms.png")
    pngs.append(out / "histograms.png")
    return pngs


def _write_markdown(out: Path, rows: list[dict[str, Any]], settings: dict[str, Any], pngs: list[Path],
                    found: dict[str, Any], plots: bool) -> None:
    """Write ``report.md`` (the settings that are set, the table, the plots, the selections and the summary found),
    print it and say what was written."""

    md = render_markdown(rows, {k: v for k, v in settings.items() if v is not None}, [str(p) for p in pngs],
                         found.get("selections"), found.get("summary"))
    write_text_atomic(out / "report.md", md)
    print(md)
    print(f"written: {out / 'report.md'}, {out / 'report.json'}" + (" and plots" if plots else ""))
