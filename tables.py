"""
Finished runs compared: the runs that differ only in their seed grouped as the seeds of one setting
(by_setting: by runs.seed_group, and apart where they differ in more), and their metrics as tables of mean ± sample
standard deviation over the seeds (results_table). `analyze.py table` and grid.py print these tables;
`analyze.py curves` groups and averages the runs' evaluations the same way. (They are here, not in analyze.py, because
a script imports no other script.)
"""

import json
import math
import re
import statistics

from cli import DataError, UsageError, is_accuracy, show_value, shown
from runs import ran_on, seed_group, setting


def change(key, value, base):
    """value against base, signed: a perplexity in % ('+3.36%', Table 7's change to lime), an accuracy in points
    ('-26.0 pts': 3.8% against 29.8% is -87% relative, which says little, and nothing is relative to 0)."""
    if is_accuracy(key):
        return f"{100 * (value - base):+.1f} pts"
    return f"{100 * (value - base) / base:+.2f}%" if base else "n/a"


def config_of(record):
    """A run's config from its record: a config.json is one, a summary holds one (if new; an older one has none: {},
    which differs in nothing)."""
    return record if "out_dir" in record else record.get("config", {})


def differences(a, b, aside=frozenset()):
    """The fields of their setting that two runs' configs both hold and differ in, sorted."""
    a, b = setting(a, aside), setting(b, aside)
    return sorted(k for k in a.keys() & b.keys() if a[k] != b[k])


def by_setting(records, items=None):
    """{row: [item, ...]}: the runs (records: their summaries or configs) that a table or a curve averages as the
    seeds of one setting; `items`, one per record, are what it groups (by default the records). A row is the runs'
    seed_group and, where runs of one seed_group differ in more than NOT_THE_SETTING (a depth ablation: n_layer; lr;
    a pruning), what sets this row apart: ((place, value as JSON), ...) at every place inside the fields where they
    differ ('n_layer', 'init_source.setting.max_steps', 'prunings.0.top_p'), and its name, unique in the seed_group
    (row_name shows it). Runs of other rows are never one mean. Runs that differ in nothing (a copy, one seed twice)
    are an error: their mean would look surer than it is."""
    records = list(records)
    settings = [setting(config_of(r)) for r in records]
    keys = [seed_group(r) for r in records]
    apart = {}  # seed_group -> the fields in which its runs differ
    for key in dict.fromkeys(keys):
        ours = [s for k, s in zip(keys, settings) if k == key]
        # NOTE a field an older run's config lacks counts as None (not set: prunings, init_source), and differs only
        # where two runs that hold it differ (a flag added since: its runs differ in nothing known)
        apart[key] = [f for f in dict.fromkeys(f for s in ours for f in s)
                      if len({json.dumps(s[f], sort_keys=True) for s in ours if f in s}) > 1]
    places = [dict(leaf for f in apart[key] for leaf in leaves(s.get(f), f)) for s, key in zip(settings, keys)]
    names = {}  # (seed_group, its places' values as JSON) -> the row's name
    for key in apart:
        held = {json.dumps(at, sort_keys=True): s for k, s, at in zip(keys, settings, places) if k == key}
        shows = {h: [] for h in held}
        for f in apart[key]:  # each field whole where that tells the rows apart, else at each place it differs
            whole = {h: named(f, s.get(f)) for h, s in held.items()}
            if len(set(whole.values())) < len({json.dumps(s.get(f), sort_keys=True) for s in held.values()}):
                at = {h: dict(leaves(s.get(f), f)) for h, s in held.items()}
                differ = [p for p in dict.fromkeys(p for a in at.values() for p in a)
                          if len({repr(a.get(p, ABSENT)) for a in at.values()}) > 1]
                whole = {h: ", ".join(named(p, at[h].get(p, ABSENT)) for p in differ) for h in held}
            for h in held:
                shows[h].append(whole[h])
        for h, parts in shows.items():
            names[key, h] = ", ".join(parts[:3]) + (f", +{len(parts) - 3} more" if len(parts) > 3 else "")
        texts = [names[key, h] for h in held]
        for i, h in enumerate(held):  # (cut short, two names may read alike: numbered, then)
            if texts.count(texts[i]) > 1:
                names[key, h] += f" #{i + 1}"
    groups, seen = {}, set()
    for record, key, at, item in zip(records, keys, places, records if items is None else items):
        held = json.dumps(at, sort_keys=True)
        values = tuple((p, json.dumps(v, sort_keys=True)) for p, v in at.items())
        row = (*key, (values, names[key, held]))
        if "seed" in record and (row, record["seed"]) in seen:
            raise UsageError(f"two of these runs are seed {record['seed']} of router {row_name(row, [row])}"
                             f"{', ' + key[0] if key[0] else ''}: a mean over seeds takes each seed once")
        seen.add((row, record.get("seed")))
        groups.setdefault(row, []).append(item)
    return groups


def leaves(value, place):
    """(place, value) at every end of a value, inside dicts and lists: ('init_source.setting.max_steps', 8)."""
    if isinstance(value, (dict, list)) and value:
        for k, x in value.items() if isinstance(value, dict) else enumerate(value):
            yield from leaves(x, f"{place}.{k}")
    else:
        yield place, value


ABSENT = type("Absent", (), dict(__repr__=lambda self: "(absent)"))()  # a place one row's value has and another not


def named(place, value):
    """A row's value at one place, as its name shows it: 'n_layer 8'; 'no prunings' where a field is not set (None)."""
    return f"no {place}" if value is None else f"{place} {shown(value, 40)}"


def mean_sd(values):
    """The mean and the sample standard deviation (0 for one value) of the seeds of one setting; with a value
    that is not finite (the last evaluation of a run that diverged), the plain mean and a NaN sd."""
    if not all(map(math.isfinite, values)):
        return sum(values) / len(values), math.nan  # (statistics refuses them)
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def results_table(summaries, split="test"):
    """Markdown. Runs of one regime and router that differ only in their seed form one row: the metric's
    mean ± sample standard deviation over them. The metric: accuracy per tier on arithmetic (in %, on the
    test or the validation split; beside them the validation loss, where every run has one), acc on ProsQA,
    perplexity on language. With one run per row, Table 7's layout instead: the metrics (the loss too, beside
    accuracies) and their change from the `lime` run of their setting."""
    prefix = "val_" if split == "val" else ""
    acc = re.compile(rf"{prefix}acc_(\d+)")
    per_run = [{int(m[1]) for k in s if (m := acc.fullmatch(k))} for s in summaries]
    tiers = set.intersection(*per_run)
    if not tiers and any(per_run):  # (not a table of perplexities in their place)
        raise UsageError(f"these runs share no tier of {split} accuracy (theirs: "
                         f"{'; '.join(sorted({','.join(map(str, sorted(t))) or 'none' for t in per_run}))})")
    metrics = [f"{prefix}acc_{n}" for n in sorted(tiers)] or \
        (["acc"] if all("acc" in s for s in summaries) else ["val_ppl"])
    if not all(isinstance(s.get(m), (int, float)) for s in summaries for m in metrics):
        raise DataError("these runs' summaries have no metric in common (accuracy per tier, acc or val_ppl)")
    if split == "val" and not metrics[0].startswith("val_acc"):
        raise UsageError("--split val: these runs have no validation accuracy (arithmetic data made before "
                         "the validation split existed, or not arithmetic)")
    accuracy = metrics[0] != "val_ppl"
    losses = sum(isinstance(s.get("val_loss"), (int, float)) for s in summaries)
    if accuracy and losses == len(summaries):
        metrics = ["val_loss", *metrics]  # the loss beside the accuracies: it separates runs that score alike
    # (a column gone without a word reads as one never measured)
    notes = f"\n\nNOTE no val loss column: {len(summaries) - losses} of these {len(summaries)} runs' summaries " \
        "have none" if accuracy and 0 < losses < len(summaries) else ""
    rows = by_setting(summaries)
    notes += unshown_differences(rows) + where_they_ran(summaries)
    if all(len(runs) == 1 for runs in rows.values()) and len({key[0] for key in rows}) == 1:
        return single_run_table(rows, metrics) + notes
    scale = {m: 100 if is_accuracy(m) else 1 for m in metrics}  # accuracies in %
    digits = {m: 1 if is_accuracy(m) else 3 for m in metrics}
    head = ["regime", "router", "seeds", *(m.replace("val_", "val ") for m in metrics)]
    ahead = accuracy and any(key[1] == "lime" for key in rows)  # (a column of dashes says nothing)
    head += ["lime ahead, last tier (pts)"] if ahead else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    stats = {key: [mean_sd([scale[m] * s[m] for s in runs]) for m in metrics] for key, runs in rows.items()}
    for (regime, router, *rest), runs in rows.items():
        cells = [regime, row_name((regime, router, *rest), rows), str(len(runs))]
        for m, (mu, sd) in zip(metrics, stats[regime, router, *rest]):
            cells.append(f"{mu:.{digits[m]}f}" + (f" ± {sd:.{digits[m]}f}" if len(runs) > 1 else ""))
        lime = stats.get(lime_row((regime, router, *rest), rows))
        if ahead:  # the means at the last tier
            cells.append("-" if lime is None or router == "lime" else
                         f"{lime[-1][0] - stats[regime, router, *rest][-1][0]:+.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + notes


def lime_row(key, rows):
    """The `lime` row (of by_setting's `rows`) that `key`'s is compared with: of its regime, preset and length, and
    where by_setting set lime's rows apart, the one of this row's own values there (lime at n_layer 4 and 8, none at
    4: lime's at 4); None where there is not one such row."""
    regime, _, preset, steps, _ = key
    mine = {p: json.dumps(v, sort_keys=True) for f, x in setting(config_of(rows[key][0])).items()
            for p, v in leaves(x, f)}
    found = [k for k in rows if k[:4] == (regime, "lime", preset, steps)
             and all(mine.get(p, "null") == v for p, v in k[4][0])]
    return found[0] if len(found) == 1 else None


def row_name(key, keys):
    """A row's router, with what sets it apart from the other rows of its regime and router: its preset or length
    where they differ, and the fields by_setting found apart: 'lime (preset deep)', 'lime (n_layer 8)'. `key`, each of
    `keys`: a row of by_setting."""
    regime, router, preset, steps, (_, name) = key
    twins = [k for k in keys if k[:2] == (regime, router)]
    apart = [name for i, name in ((2, f"preset {preset}"), (3, f"{steps} steps")) if len({k[i] for k in twins}) > 1]
    apart += [name] if name else []
    return f"{router} ({', '.join(apart)})" if apart else router


def unshown_differences(rows):
    """A note for under a table whose rows (by_setting's) of one regime differ in more than the router they show: in
    their preset, length, lr, depth, or in starting from a run (--init-from)... Each such field with every row's
    value; '' where there is none. A comparison of methods trains them alike, and a table that is not one says so.
    Rows of different regimes are not compared: what the regime sets (a block or vocabulary that fits its data, as
    grid.py gives each) may differ between them, and the table compares routers within a regime only."""
    aside = {"router", "task", "preset", "max_steps"}  # (the regime is a column; steps below)
    regimes, named = {}, {}
    for (regime, router, preset, steps, (values, _)), runs in rows.items():
        row_setting = dict(setting(config_of(runs[0]), aside), preset=preset, steps=steps)
        source = row_setting.get("init_source")
        if isinstance(source, dict) and isinstance(source.get("setting"), dict):  # a fine-tune's source: its router
            # is the row's (a fine-tune takes its source's model), set aside as the row's own
            row_setting["init_source"] = dict(source, setting={k: v for k, v in source["setting"].items()
                                                               if k != "router"})
        regimes.setdefault(regime, []).append((router, row_setting))
        fields = {p.split(".")[0] for p, _ in values}
        named[regime] = named.get(regime, fields) & fields
    for regime, settings in regimes.items():  # (what every row's name shows already: n_layer in a depth ablation)
        for _, values in settings:
            for field in named[regime]:
                values.pop(field, None)
    notes = []
    for regime, settings in regimes.items():
        differ = [k for k in dict.fromkeys(k for _, s in settings for k in s)
                  if len({json.dumps(s[k]) for _, s in settings if k in s}) > 1]
        if differ:
            values = [f"{place} ({', '.join(f'{router} {as_noted(v)}' for router, v in held)})"
                      for k in differ for place, held in where_they_differ(k, settings)]
            which = f" of {regime}" if len(regimes) > 1 else ""
            notes.append(f"\n\nNOTE the rows{which} differ in more than their router: " + "; ".join(values))
    return "".join(notes)


def where_they_differ(field, settings):
    """(place, [(router, value)]) where the rows' values of `field` differ: the field whole, or where every row's is
    a dict (a fine-tune's source), each place inside it that differs ('init_source.setting.lr'), not the whole."""
    held = [(router, s[field]) for router, s in settings if field in s]
    if not all(isinstance(v, dict) for _, v in held):
        return [(field, held)]
    at = [(router, dict(leaves(v, field))) for router, v in held]
    places = dict.fromkeys(p for _, a in at for p in a)
    return [(p, [(router, a.get(p, ABSENT)) for router, a in at]) for p in places
            if len({repr(a.get(p, ABSENT)) for _, a in at}) > 1]


def as_noted(value):
    """A field's value in unshown_differences' NOTE: 'not set' where it is None (no prunings), not 'None'."""
    return "not set" if value is None else value


def where_they_ran(summaries):
    """A note for under a table whose runs did not all run on one kind of device in one dtype, as their summaries'
    sessions say (a run resumed on a CPU after a GPU: float32 from there, where the GPU ran bf16): which runs ran
    how. '' where they all ran alike, or their summaries do not say (runs older than the sessions). A run whose first
    recorded session began after step 0 (begun before sessions were logged, or its log moved away) says so."""
    how = {}
    for s in summaries:
        sessions = s.get("sessions") if isinstance(s.get("sessions"), list) else []
        path, last = [], None  # each change of device kind or dtype: "cuda bfloat16", "cpu float32 from step 34000"
        prunings = config_of(s).get("prunings")
        saved_at = [p.get("step") for p in prunings if isinstance(p, dict)] if isinstance(prunings, list) else []
        for x in (x for x in sessions if isinstance(x, dict)):
            kind = ran_on(x)
            if last is None and x.get("step") != 0:  # (not "ran as its first recorded session did from the start")
                # a model of analyze.py prune --save: its steps before the pruning are the pruned run's, logged there
                path.append("in the run it was pruned from" if x.get("step") in saved_at else "not recorded")
            if kind != last:
                path.append(kind if not path else f"{kind} from step {x.get('step')}")
                last = kind
        if path:
            how.setdefault(", then ".join(path), []).append(f"{s.get('router')} seed {s.get('seed')}")
    if len(how) < 2 and not any(", then " in k for k in how):
        return ""
    return "\n\nNOTE these runs did not all run alike: " + "; ".join(f"{k} ({', '.join(v)})" for k, v in how.items())


def single_run_table(rows, metrics):
    """Table 7's layout, for one run per row (by_setting's): each run's metrics as saved, and their change from the
    `lime` run of its setting (lime_row: at its depth, in a depth ablation), where there is one."""
    keys = list(rows)
    bases = {key: lime_row(key, rows) for key in keys}
    compared = any(base not in (None, key) for key, base in bases.items())  # (a column of dashes says nothing)
    names = ["perplexity" if m == "val_ppl" else m.replace("val_", "val ") for m in metrics]  # as the other table
    head = ["router", *names] + ([f"change to lime ({m})" for m in names] if compared else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        s, base = rows[key][0], bases[key]
        cells = [row_name(key, keys), *(show_value(m, s[m]) for m in metrics)]
        if compared:
            cells += ["-" if base in (None, key) else change(m, s[m], rows[base][0][m]) for m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
