"""Run one conversion: Source -> ModelMap -> Decode -> Layout.encode -> Writer.

:func:`moeconvert.plan.plan_conversion` fixes the whole output first (importable from here too).
:func:`run_conversion` then streams: pass-through tensors are copied byte for byte,
MoE layers are decoded and encoded a chunk of experts at a time.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moeconvert import __version__
from moeconvert.format import CONFIG_NAME, FORMAT_VERSION
from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.integrations.vllm.scope import load_format, refusal
from moeconvert.jobs import (Request, attempts, job_source_files, layer_output_block, plan_jobs,  # noqa: F401
                             plan_key, read_records, rehash_sources, source_stat, still_good, write_record)
# the plan lives beneath jobs and the writer; these names stay importable from here
from moeconvert.plan import (DEFAULT_CHUNK_BYTES, DEFAULT_JOB_BYTES, ConversionPlan, LayerPlan,  # noqa: F401
                             check_layers, decoder_problems, group_by_layers, layer_shape, output_scheme,
                             plan_conversion, scheme_kind)
from moeconvert.writer import StagedOutput


@dataclass
class Conversion:
    """What :func:`run_conversion` did: the manifest written, and how many jobs ran (``kept``: done
    by an interrupted run and taken over by ``--resume``; ``retried``: extra attempts after a worker
    was lost)."""

    manifest: dict
    jobs: int
    kept: int
    ran: int
    retried: int


def run_conversion(plan: ConversionPlan, out: Path, *, overwrite: bool = False,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Callable[[int], None] | None = None,
                   request: Request | None = None, executor=None,
                   resume: bool = False, job_bytes: int = DEFAULT_JOB_BYTES,
                   report: Callable[[str], None] | None = None) -> "Conversion":
    """Write the planned output to ``out`` as jobs (:mod:`moeconvert.jobs`) run by ``executor`` (one of
    :mod:`moeconvert.executors`; threads of this process by default), then finalize: index, copied files,
    the manifest last, one rename. ``request`` says how to plan it again (executors that run jobs in
    other processes need it); ``resume`` takes over the staging folder a killed run of the same plan left.
    ``report(line)`` hears what the run decided (jobs kept by ``--resume``, retries)."""
    from moeconvert.executors import InProcess, available_cores

    if plan.model.family.plan_only:  # before anything is written (families.py says why)
        raise MoeConvertError(f"{plan.model.family.name} is planned, not converted: {plan.model.family.plan_only}",
                              file=CONFIG_NAME, tensor="model_type")
    progress = progress or (lambda n: None)
    report = report or (lambda line: None)
    request = request or Request(plan.source.ident, plan.layout.name, chunk_bytes=chunk_bytes, job_bytes=job_bytes)
    jobs = plan_jobs(plan, request.chunk_bytes, request.job_bytes)
    key = plan_key(plan, jobs, request)
    executor = executor or InProcess()
    record = {"key": key, "tool_version": __version__, "request": request.to_json(), "jobs": len(jobs),
              "source_stat": source_stat(plan)}
    with StagedOutput(out, plan.shards, overwrite, plan=record, resume=resume) as staged:
        done: dict[int, dict] = {}
        if staged.resumed_from is not None:
            done = _resumable(plan, jobs, key, staged, progress, report)
        kept = sum(1 for i in done if jobs[i].kind != "digest")  # the source digests were made again here
        todo = [j for j in jobs if j.index not in done]
        started = attempts(staged.staging)
        done.update(executor.run(plan, request, key, staged.staging, todo, progress))
        missing = [j.index for j in jobs if j.index not in done]
        if missing:
            raise InternalError(f"jobs {missing[:5]} ended without a record")
        runs = attempts(staged.staging)
        retried = {i: runs.get(i, 0) - started.get(i, 0) - 1 for i in (j.index for j in todo)}
        retried = {i: n for i, n in retried.items() if n > 0}
        if retried:
            report(f"{len(retried)} job(s) ran again after a worker was lost: "
                   + ", ".join(f"{jobs[i].what} ({n + 1} attempts)" for i, n in sorted(retried.items())[:5]))
        stats = {"jobs": len(jobs), "kept": kept, "ran": len(jobs) - kept,
                 "retried": sum(retried.values())}
        copies = plan.source.other_files()  # listed once: the manifest's checksums are of exactly these
        digests = {}
        quality = {}
        facts: dict[int, list] = {}  # layer index -> the scan's facts of each pass (layouts that scan)
        source_digests = {}
        for j in jobs:
            # records come from this process, a pipe or a JSON file (keys sorted): one key order for
            # all, so that the manifest's bytes do not depend on which run did which job
            rec = json.loads(json.dumps(done[j.index], sort_keys=True))
            digests.update(rec.get("tensors", {}))
            if "quality" in rec:
                quality[plan.layers[j.layer].map.prefix] = rec["quality"]
            if "layout_facts" in rec:
                facts[j.layer] = rec["layout_facts"]
            if j.kind == "digest":
                source_digests[plan.source.files[j.file]] = rec["digest"]
        rewritten = {CONFIG_NAME: served} if (served := served_config(plan)) is not None else {}
        manifest = build_manifest(plan, digests, quality, source_digests, copies, rewritten, facts)
        index = {"metadata": {"total_size": sum(t.nbytes for t in plan.tensors)},
                 "weight_map": {t.name: plan.shards[t.shard].filename for t in plan.tensors}}
        staged.finish(index, copies, manifest, rewritten)
    return Conversion(manifest, **stats)


def _resumable(plan: ConversionPlan, jobs, key: str, staged: StagedOutput, progress, report) -> dict[int, dict]:
    """The records of the interrupted run that ``--resume`` keeps, after checking, in this order: that
    each is well formed (:func:`read_records`), that the source files hash to what it recorded (else
    refused: :func:`rehash_sources`), that each kept job read only such files, and that its bytes in
    the staging folder still hash to its record. The fresh source digests are kept too."""
    from moeconvert.executors import available_cores

    found = read_records(staged.staging, key, jobs, plan)
    earlier_digests = {i: r for i, r in found.items() if jobs[i].kind == "digest"}
    try:
        fresh, unchanged = rehash_sources(plan, jobs, key, earlier_digests, progress, available_cores())
    except MoeConvertError:
        staged.hand_back()  # the interrupted run's folder, as it was: the user decides
        raise
    for i, rec in fresh.items():
        write_record(staged.staging, i, rec)
    others = {i: r for i, r in found.items() if jobs[i].kind != "digest"}
    tied = {i: r for i, r in others.items() if job_source_files(plan, jobs[i]) <= unchanged}
    with ThreadPoolExecutor(available_cores()) as pool:  # re-hashing what was written: I/O and hashlib
        good = dict(zip(tied, pool.map(lambda i: still_good(plan, jobs[i], tied[i], staged.staging), tied)))
    kept = {i: r for i, r in tied.items() if good[i]}
    redone = []
    if len(tied) > len(kept):
        redone.append(f"{len(tied) - len(kept)} whose bytes no longer match their record")
    if len(others) > len(tied):
        redone.append(f"{len(others) - len(tied)} whose source file the interrupted run had not hashed yet")
    non_digest = sum(1 for j in jobs if j.kind != "digest")
    report(f"resuming {staged.resumed_from.name}: source files hashed again and unchanged; {len(kept)} of "
           f"{non_digest} layer and copy jobs done and checked, {non_digest - len(kept)} to run"
           + (f" (redone: {'; '.join(redone)})" if redone else ""))
    for i in kept:
        progress(jobs[i].work_bytes)
    return {**kept, **fresh}


def served_config(plan: ConversionPlan) -> bytes | None:
    """The config.json of an output vLLM serves through moeconvert's plugin (layouts that say
    a ``vllm_method``), else None (config.json is copied as it is).

    Only ``quantization_config`` changes: it names the plugin's method and keeps the source's own (for
    every layer that is not an MoE expert, e.g. compressed-tensors linear layers) under
    ``source_quantization_config``. The dtype is there too: vLLM checks it before the plugin reads the
    manifest. docs/vllm.md says more.
    """
    layout = plan.layout
    if layout.vllm_method is None or vllm_refusal(plan) is not None:
        return None
    config = dict(plan.source.config)
    source_qc = None
    for key in ("quantization_config", "compression_config"):  # where transformers reads it, in that order
        if config.get(key) is not None and source_qc is None:
            source_qc = config[key]
        config.pop(key, None)
    config["quantization_config"] = {
        "quant_method": "moeconvert",
        "format_version": FORMAT_VERSION,
        "layout": {"name": layout.name, "version": layout.version},
        "made_for": dict(layout.made_for),
        "dtype": plan.dtype,
        "partition": plan.partition.to_json(),
        "source_quantization_config": source_qc,
    }
    need = load_format(plan.model.family.name)
    if need is not None:  # what `vllm serve` needs to be told (docs/vllm.md); the plugin refuses any other
        config["quantization_config"]["load_format"] = need
    return (json.dumps(config, indent=2) + "\n").encode()


def vllm_refusal(plan: ConversionPlan) -> str | None:
    """Why moeconvert's vLLM plugin would refuse the folder of a layout it serves (the plugin's own sentence,
    ``integrations/vllm/scope.py``); None when it serves it, or when the layout is not for vLLM at all."""
    if plan.layout.vllm_method is None:
        return None
    kinds = {lp.scheme.kind for lp in plan.layers}
    return refusal(plan.layout.name, kinds.pop() if len(kinds) == 1 else None, plan.model.family.name,
                   [(lp.map.activation, lp.map.activation_params or {}) for lp in plan.layers])


def tp_size_entry(st, entry, rank_metadata: list[dict] | None = None) -> dict:
    """A layer's ``tp_sizes`` value for one TP size: cut from the full tensors, or stored (docs/format.md);
    ``rank_metadata``: each rank's ``layout_metadata`` with what its data decided (layouts that scan)."""
    if st is None:
        return {"stored": False}
    return {"stored": True, "intermediate_size": st.unpadded[1],
            "intermediate_size_padded": st.metadata.get("intermediate_size_padded", st.shape.intermediate_size),
            "hidden_size_padded": st.metadata.get("hidden_size_padded", st.shape.hidden_size),
            "layout_metadata": st.metadata,
            **({"rank_layout_metadata": rank_metadata} if rank_metadata is not None else {}),
            "tensors": {suffix: entry(t) for suffix, t in st.tensors.items()}}


def _with_facts(plan: ConversionPlan, lp: LayerPlan, facts: list | None) -> tuple[dict, dict[int, list[dict]]]:
    """A layer's ``layout_metadata``, and each stored TP size's per-rank ones, with what its job's scans found
    (one set of facts per pass: the full tensors, then each stored TP rank, as ``jobs.run_job`` runs them)."""
    if facts is None:
        return lp.metadata, {}
    layout, passes = plan.layout, iter(facts)
    full = layout.layer_metadata(lp.shape, lp.scheme, next(passes))
    ranks = {T: [layout.layer_metadata(st.shape, lp.scheme, next(passes)) for _ in range(T)]
             for T, st in lp.tp_sizes.items() if st}
    return full, ranks


def build_manifest(plan: ConversionPlan, digests: dict[str, str], quality: dict[str, dict], source_digests: dict,
                   copies: list[Path], rewritten: dict[str, bytes] | None = None,
                   facts: dict[int, list] | None = None) -> dict:
    """The manifest (docs/format.md): every tensor's sha256 as written, every shard header's, and those
    of the files copied through (``copies``), so that ``verify`` and ``load(verify=True)`` can check
    every byte of the output without its source. ``digests``: each written tensor's sha256 (from the
    jobs' records); ``quality``: each quantized layer's report, by prefix; ``facts``: what the layer jobs'
    scans found (``Layout.layer_scan``), by layer index."""
    src = plan.source
    entry = lambda t: {"name": t.name, "file": plan.shards[t.shard].filename, "shape": list(t.shape),
                       "dtype": t.dtype, "sha256": digests[t.name]}
    layouts = plan.layout
    schemes = {lp.scheme for lp in plan.layers}
    layers = []
    for i, lp in enumerate(plan.layers):
        m = lp.map
        metadata, rank_metadata = _with_facts(plan, lp, (facts or {}).get(i))
        layers.append({
            "prefix": m.prefix,
            "layer": m.layer,
            "num_experts": lp.shape.num_experts,
            "num_experts_global": m.num_experts,
            "expert_offset": lp.expert_start,
            "top_k": m.top_k,
            "hidden_size": m.hidden_size,
            "intermediate_size": lp.unpadded[1],
            "intermediate_size_total": m.intermediate_size,
            "intermediate_size_padded": lp.metadata.get("intermediate_size_padded", lp.shape.intermediate_size),
            "hidden_size_padded": lp.metadata.get("hidden_size_padded", lp.shape.hidden_size),
            "activation": m.activation,
            "activation_params": m.activation_params,
            "has_bias": m.has_bias,
            "bias_dtype": lp.shape.bias_dtype,
            # written only where true, so that every other family's manifest reads as before
            **({"apply_router_weight_on_input": True} if m.router_on_input else {}),
            # LongCat-Flash's zero-computation experts: no tensors, the router's ids E .. E + n - 1
            **({"zero_experts": {"num": m.zero_experts, "type": m.zero_expert_type}} if m.zero_experts else {}),
            "scheme": lp.scheme.to_json(),
            "source_scheme": m.scheme.to_json(),
            "router": m.router,
            "shared_experts": m.shared,
            "layout_metadata": metadata,
            "warnings": lp.warnings,
            "tensors": {suffix: entry(t) for suffix, t in lp.tensors.items()},
            **({"quality": quality[m.prefix]} if lp.quantized else {}),
            **({"tp_sizes": {str(T): tp_size_entry(st, entry, rank_metadata.get(T)) for T, st in lp.tp_sizes.items()}}
               if lp.tp_sizes else {}),
        })
    return {
        "format": "moeconvert",
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "source": {
            "id": src.ident,
            "revision": src.revision,
            "files": {f.name: d for f, d in sorted(source_digests.items(), key=lambda kv: kv[0].name)},
        },
        "family": plan.model.family.name,
        "dtype": plan.dtype,
        "quantization": plan.quant.to_json() if plan.quant is not None else None,
        "scheme": next(iter(schemes)).to_json() if len(schemes) == 1 else None,
        "backend": layouts.name,
        "layout": {"name": layouts.name, "version": layouts.version, "kernel": layouts.kernel,
                   "made_for": dict(layouts.made_for)},
        "partition": plan.partition.to_json(),
        "moe_layers": layers,
        "tensors": {t.name: entry(t) for t in plan.tensors if t.source is not None},
        # a header's sha256 covers everything before the shard's data (its 8-byte length, the JSON,
        # ``__metadata__`` and padding included); the tensors' digests cover the rest
        "shards": [{"file": s.filename, "size": s.size, "header_sha256": hashlib.sha256(s.header).hexdigest()}
                   for s in plan.shards],
        # the digests of the files as written: copied byte for byte, or rewritten (config.json for vLLM)
        "copied_files": {p.name: ({"sha256": hashlib.sha256(rewritten[p.name]).hexdigest(),
                                   "size": len(rewritten[p.name])} if p.name in (rewritten or {})
                                  else src.file_digest(p)) for p in copies},
    }
