"""``st-prompts bank``: many tasks on one frozen backbone (named prompt sets).

    st-prompts bank train my-bank sts --data ../shared/data/senteval/STS/STSBenchmark/sts-train.csv \
        --dev ../shared/data/senteval/STS/STSBenchmark/sts-dev.csv --dev-limit 500   # creates my-bank
    st-prompts bank train my-bank nli --data ../shared/data/train/nli_triplets.csv --loss mnrl --data-dir ../shared/data
    st-prompts train dcpcse --data-dir ../shared/data --pooling mean --prompts-only   # trained alone, pooled as the bank
    st-prompts bank add my-bank dcpcse outputs/dcpcse-unsup-cpu-prompts
    st-prompts bank export my-bank sts sts-prompts                     # one set, a prompts-only checkpoint
    st-prompts bank roles my-bank --default sts
    st-prompts bank list my-bank

``--data`` and ``--dev`` read SentEval's files as distributed (STS-B's ``sts-*.csv``, SICK's ``SICK_*.txt``: scored
pairs) as well as CSV, TSV, JSON-lines and text files; ``../shared/data`` is the ``--data-dir`` layout (``senteval/``,
``train/``). A bank is a sentence-transformers model folder
(``SentenceTransformer("my-bank", trust_remote_code=True)``). Every change loads it, changes it and replaces the
folder atomically, one writer at a time; a folder st-prompts did not write is never replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os

from st_prompts.commands import _numbers as n
from st_prompts.commands.options import (add_no_progress_argument, add_trust_remote_code_argument, cli_text,
                                         show_progress)
from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.prompts.spec import MAX_PREFIX_LENGTH

logger = logging.getLogger(__name__)

LOSSES = ("cosent", "mnrl", "dcpcse")
#: ``bank train``'s evaluation interval: the CPU presets' of ``st-prompts train`` (on a CPU a dev evaluation costs more
#: than many training steps).
EVAL_STEPS = 50


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bank", help="many tasks on one frozen backbone: train, add, list prompt sets",
                                   description=cli_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="bank_command", metavar="ACTION", required=True)

    create = actions.add_parser("create", help="an empty bank on a backbone")
    create.add_argument("bank", help="folder of the bank to create")
    _backbone_options(create)
    create.add_argument("--overwrite", action="store_true", help="replace a bank st-prompts saved there")
    create.set_defaults(func=run_create)

    train = actions.add_parser("train", help="train one prompt set (the others stay frozen) and save the bank",
                               description="Train the prompt set NAME of BANK (created on --backbone if missing) "
                               "from a CSV/TSV/JSON-lines file of scored pairs, pairs, triplets or sentences.")
    train.add_argument("bank", help="folder of the bank (created if missing)")
    train.add_argument("name", help="name of the prompt set to train (created if missing)")
    train.add_argument("--data", required=True, help="training file: scored pairs (two text columns and a score), "
                       "pairs, triplets or sentences (.csv, .tsv, .jsonl)")
    train.add_argument("--loss", choices=LOSSES, help="cosent (scored pairs), mnrl (pairs or triplets: multiple "
                       "negatives ranking), dcpcse (DCPCSE's InfoNCE with dropout views; sentences); default: by the "
                       "data's shape")
    train.add_argument("--dev", help="scored pairs for model selection (default: STS-B dev of --data-dir/--senteval-dir "
                       "if given, else no selection)")
    train.add_argument("--data-dir", help="folder with senteval/ (STS-B dev selects the best weights)")
    train.add_argument("--senteval-dir", help="SentEval folder (STS-B dev selects the best weights)")
    train.add_argument("--prefix-length", type=n.positive_int(MAX_PREFIX_LENGTH), default=16,
                       help="prefix positions of a new set (default: 16)")
    train.add_argument("--learning-rate", "--lr", type=n.positive_float(10.0), default=1e-1, help="peak learning rate "
                       "(default 1e-1: the best on average over the multitask study's tasks with the gate)")
    train.add_argument("--no-gate", dest="prefix_gate", action="store_false", help="a new set without the "
                       "zero-initialised gate (the ungated prefix of earlier versions; it changes the model before it "
                       "trains; use --lr 1e-2 to 3e-2 with it); default: gated, so a new set starts as the backbone")
    train.add_argument("--epochs", type=n.positive_float(1e6), default=1.0, help="training epochs (default 1)")
    train.add_argument("--batch-size", type=n.positive_int(1 << 20), default=32, help="batch size (default 32)")
    train.add_argument("--max-steps", type=n.int_range(-1), default=-1,
                       help="stop after this many steps (-1: the epochs)")
    train.add_argument("--eval-steps", type=n.positive_int(), default=EVAL_STEPS,
                       help=f"evaluate the dev set every this many steps, besides before the first step and after the "
                       f"last (default {EVAL_STEPS}, as st-prompts train --scale cpu)")
    train.add_argument("--dev-limit", type=n.int_range(2), metavar="N", help="select the weights on N dev pairs "
                       "(evenly spaced) instead of all of them, then evaluate the selected weights on the whole dev "
                       "set once, as st-prompts train --dev-limit (default: the whole dev set at every evaluation)")
    train.add_argument("--limit", type=n.positive_int(), help="train on the first N rows")
    train.add_argument("--seed", type=n.seed, default=42, help="random seed (default 42)")
    train.add_argument("--replace", action="store_true", help="retrain NAME from scratch if the bank has it")
    _output_options(train)
    _backbone_options(train)
    add_trust_remote_code_argument(train)
    add_no_progress_argument(train)
    train.set_defaults(func=run_train)

    add = actions.add_parser("add", help="add a trained prompt set (a model folder or prompts-only checkpoint)")
    add.add_argument("bank", help="folder of the bank")
    add.add_argument("name", help="name of the new prompt set")
    add.add_argument("source", help="a saved st_prompts model folder or prompts-only checkpoint on the same backbone "
                     "(one set of another bank: bank export it first)")
    _output_options(add)
    add_trust_remote_code_argument(add)
    add.set_defaults(func=run_add)

    export = actions.add_parser("export", help="one prompt set as a prompts-only checkpoint (loads alone; adds to "
                                "another bank)")
    export.add_argument("bank", help="folder of the bank")
    export.add_argument("name", help="name of the prompt set to export")
    export.add_argument("out", help="folder to write the checkpoint to")
    export.add_argument("--overwrite", action="store_true", help="replace a checkpoint st-prompts saved there")
    add_trust_remote_code_argument(export)
    export.set_defaults(func=run_export)

    remove = actions.add_parser("remove", help="remove a prompt set")
    remove.add_argument("bank", help="folder of the bank")
    remove.add_argument("name", help="name of the prompt set to remove")
    _output_options(remove)
    add_trust_remote_code_argument(remove)
    remove.set_defaults(func=run_remove)

    roles = actions.add_parser("roles", help="which set encodes without a task, and the query and document sets")
    roles.add_argument("bank", help="folder of the bank")
    for role in ("default", "query", "document"):
        roles.add_argument(f"--{role}", help=f"the {role} set (a name; 'none' to unset)")
    _output_options(roles)
    add_trust_remote_code_argument(roles)
    roles.set_defaults(func=run_roles)

    show = actions.add_parser("list", help="the prompt sets of a bank, their sizes and roles (a table; --json)")
    show.add_argument("bank", help="folder of the bank")
    show.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    add_trust_remote_code_argument(show)
    show.set_defaults(func=run_list)


def _output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", metavar="DIR", help="write the changed bank to DIR and leave BANK as it is (e.g. a "
                        "bank saved by model.save, which st-prompts never replaces)")
    parser.add_argument("--overwrite", action="store_true", help="with --output: replace a bank st-prompts saved at "
                        "DIR")


def _backbone_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backbone", default="minilm", help="backbone of a new bank (default: minilm, the packaged "
                        "all-MiniLM-L6-v2; its own pooling is kept)")
    parser.add_argument("--pooling", choices=("mean", "cls", "lasttoken", "max"),
                        help="pooling of a new bank (default: the backbone's own, else mean)")


def _load(path: str, trust_remote_code):
    from st_prompts.bank import bank_encoder
    from st_prompts.loading import load_sentence_model

    model = load_sentence_model(path, trust_remote_code=trust_remote_code)
    bank_encoder(model)
    return model


def _save(model, path: str, overwrite: bool = True) -> None:
    from st_prompts.bank import save_bank
    from st_prompts.modules.set_checks import check_finite_training

    check_finite_training(model, None)  # never save NaN or infinite prompts (a diverged set, or one added)
    save_bank(model, path, overwrite=overwrite)


def _summary(model, path: str) -> dict:
    from st_prompts.bank import bank_encoder
    from st_prompts.sizes import prompt_set_size

    encoder = bank_encoder(model)
    sizes = {name: prompt_set_size(e) for name, e in encoder.prompt_sets.items()}
    # parameters: what training updates (a reparameterised set's MLP included); bytes: what the bank stores
    sets = {name: {"prefix_length": e.prefix_length, "parameters": sizes[name].trainable_parameters,
                   "stored_parameters": sizes[name].stored_parameters, "bytes": sizes[name].stored_bytes,
                   **({"trained": encoder.prompt_set_info[name]} if encoder.prompt_set_info.get(name) else {})}
            for name, e in encoder.prompt_sets.items()}
    return {"bank": path, "backbone": encoder.backbone_reference, "sets": sets, "default": encoder.default_task,
            "query": encoder.query_task, "document": encoder.document_task}


def _changed_bank_destination(args) -> str:
    """Where a changed bank is written: ``--output``, else ``BANK`` itself, which must be a bank st-prompts saved
    (checked before anything loads; the refusal says how to go on)."""
    from st_prompts.bank import BANK_KIND
    from st_prompts.storage import MANIFEST_FILE, check_model_destination, read_manifest

    if getattr(args, "output", None):
        check_model_destination(args.output, args.overwrite, kind=BANK_KIND)
        return args.output
    if getattr(args, "overwrite", False):
        raise ConfigurationError("--overwrite applies to --output DIR; BANK itself is always replaced by the change.")
    if os.path.isdir(args.bank) and read_manifest(args.bank) is None and os.listdir(args.bank):
        raise ConfigurationError(f"{args.bank} was not saved by st-prompts (it has no {MANIFEST_FILE}: model.save "
                                 "writes none), so it is never replaced; pass --output DIR to write the changed bank "
                                 "to a new folder (or save banks with st_prompts.bank.save_bank)")
    if os.path.isdir(args.bank) and os.listdir(args.bank):
        check_model_destination(args.bank, True, kind=BANK_KIND)  # a model, an index, foreign files: refused
    return args.bank


@contextlib.contextmanager
def _locks(*folders: str):
    """The locks of ``folders``, always taken in one order (two commands crossing BANK and --output never wait on
    each other for ever)."""
    from st_prompts.storage import folder_lock

    with contextlib.ExitStack() as stack:
        for folder in sorted({os.path.realpath(f) for f in folders}):
            stack.enter_context(folder_lock(folder))
        yield


def _modify(args, change) -> int:
    out = _changed_bank_destination(args)
    with _locks(args.bank, out):  # load, change and save as one step: a concurrent change waits, none is lost
        model = _load(args.bank, args.trust_remote_code)
        change(model)
        _save(model, out, overwrite=out == args.bank or args.overwrite)
    print(json.dumps(_summary(model, out), indent=2))
    return 0


def run_create(args: argparse.Namespace) -> int:
    from st_prompts.bank import BANK_KIND, create_bank
    from st_prompts.storage import check_model_destination

    check_model_destination(args.bank, args.overwrite, kind=BANK_KIND)
    model = create_bank(args.backbone, pooling=args.pooling)
    _save(model, args.bank, overwrite=args.overwrite)
    print(json.dumps(_summary(model, args.bank), indent=2))
    return 0


def run_add(args: argparse.Namespace) -> int:
    from st_prompts.bank import add_prompt_set
    from st_prompts.prompts.names import check_set_name

    check_set_name(args.name)  # before anything loads (the library checks it again)
    return _modify(args, lambda model: add_prompt_set(model, args.name, args.source))


def run_export(args: argparse.Namespace) -> int:
    from st_prompts.bank import export_prompt_set

    path = export_prompt_set(args.bank, args.name, args.out, overwrite=args.overwrite,
                             trust_remote_code=args.trust_remote_code)
    print(json.dumps({"bank": args.bank, "set": args.name, "checkpoint": str(path)}, indent=2))
    return 0


def run_remove(args: argparse.Namespace) -> int:
    from st_prompts.bank import remove_prompt_set

    return _modify(args, lambda model: remove_prompt_set(model, args.name))


def run_roles(args: argparse.Namespace) -> int:
    from st_prompts.bank import bank_encoder

    def change(model) -> None:
        encoder = bank_encoder(model)
        for role in ("default", "query", "document"):
            value = getattr(args, role)
            if value is None:
                continue
            if value != "none":
                encoder.resolve_task(value)  # an unknown name is refused here
                if value in ("query", "document") and value not in encoder.prompt_sets:
                    raise ConfigurationError(f"No prompt set {value!r}.")
            setattr(encoder, f"{role}_task", None if value == "none" else value)

    return _modify(args, change)


def run_list(args: argparse.Namespace) -> int:
    summary = _summary(_load(args.bank, args.trust_remote_code), args.bank)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def _size(count: int) -> str:
    return f"{count / 1024:,.0f} KiB" if count >= 1024 else f"{count} B"


def format_summary(summary: dict) -> str:
    """``bank list``'s table: one row per prompt set (positions, trainable and stored parameters, stored size, roles,
    what it was trained on and its selection score where recorded)."""
    roles: dict[str, list[str]] = {}
    for role in ("default", "query", "document"):
        if summary.get(role):
            roles.setdefault(summary[role], []).append(role)
    lines = [f"{summary['bank']}: {len(summary['sets'])} prompt set(s) on {summary['backbone']}"]
    if not summary["sets"]:
        return "\n".join([*lines, "(no prompt sets: it encodes as the backbone; add one with bank train or bank add)"])
    header = ("set", "prefix", "trainable", "stored", "size", "roles", "trained on", "selection score (step)")
    rows = []
    for name, info in summary["sets"].items():
        record = info.get("trained", {})
        trained = ", ".join(part for part in (f"{record['rows']:,} rows" if "rows" in record else "",
                                              record.get("loss", "")) if part)
        score = f"{100 * record['best_score']:.2f} ({record.get('best_step')})" if "best_score" in record else ""
        rows.append((name, str(info["prefix_length"]), f"{info['parameters']:,}",
                     f"{info.get('stored_parameters', info['parameters']):,}", _size(info["bytes"]),
                     ", ".join(roles.get(name, [])), trained, score))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (header, *rows)]
    return "\n".join(lines)


def run_train(args: argparse.Namespace) -> int:
    from st_prompts.bank import BANK_KIND, create_bank, train_prompt_set
    from st_prompts.data.task_data import KINDS, LOSS_KINDS, read_task_file
    from st_prompts.methods.models import backbone_kwargs
    from st_prompts.modules.set_checks import check_finite_training
    from st_prompts.prompts.names import check_set_name
    from st_prompts.storage import check_model_destination

    check_set_name(args.name)  # before anything loads (the library checks it again)
    data = read_task_file(args.data, limit=args.limit)
    loss_name = args.loss or KINDS[data.kind]
    if data.kind not in LOSS_KINDS[loss_name]:
        raise ConfigurationError(f"--loss {loss_name} trains on {' or '.join(LOSS_KINDS[loss_name])}; {args.data} "
                                 f"holds {data.kind}.")
    full_dev = _evaluator(args)  # a bad dev file or option is refused before the bank loads
    selection = _selection(full_dev, args.dev_limit)
    out = args.output or args.bank
    with _locks(args.bank, out):
        if os.path.isdir(args.bank) and os.listdir(args.bank):
            _changed_bank_destination(args)  # replaceable? Asked before training, not after
            model = _load(args.bank, args.trust_remote_code)
        else:
            if args.output:
                raise ConfigurationError(f"{args.bank} holds no bank: --output DIR is for changing an existing one "
                                         "(a missing BANK is created where it is named).")
            check_model_destination(out, overwrite=False, kind=BANK_KIND)
            model = create_bank(args.backbone, pooling=args.pooling, **backbone_kwargs(args))
        encoder = model[0]
        if args.name in encoder.prompt_sets:
            if not args.replace:
                raise ConfigurationError(f"{args.bank} already has a prompt set {args.name!r}: pass --replace to "
                                         "retrain it from scratch, or choose another name.")
            encoder.remove_prompt_set(args.name)
        result = train_prompt_set(
            model, args.name, data.dataset, _loss(loss_name, model), evaluator=selection,
            learning_rate=args.learning_rate, epochs=args.epochs, batch_size=args.batch_size,
            max_steps=args.max_steps, eval_steps=args.eval_steps, seed=args.seed,
            show_progress_bar=show_progress(args), prefix_length=args.prefix_length,
            prefix_gate=args.prefix_gate,
        )
        check_finite_training(model, result.best_metric)
        best_dev, selection_dev = result.best_metric, None
        if selection is not full_dev and result.best_metric is not None:  # selected on a subset: the whole dev once
            selection_dev, best_dev = result.best_metric, _whole_dev_score(model, full_dev)
        _save(model, out, overwrite=out == args.bank or args.overwrite)
    summary = _summary(model, out)
    summary["trained"] = {"name": args.name, "loss": loss_name, "data": data.kind, "rows": len(data.dataset),
                          "steps": result.steps, "best_dev": best_dev, "best_step": result.best_step,
                          **({"selection_dev_pairs": len(selection.sentences1), "selection_dev": selection_dev}
                             if selection_dev is not None else {}),
                          "seconds": round(result.seconds, 1)}
    print(json.dumps(summary, indent=2))
    return 0


def _loss(name: str, model):
    from sentence_transformers.sentence_transformer.losses import CoSENTLoss, MultipleNegativesRankingLoss

    from st_prompts.losses import PromptContrastiveLoss

    losses = {"cosent": CoSENTLoss, "mnrl": MultipleNegativesRankingLoss,
              "dcpcse": lambda model: PromptContrastiveLoss(model, mlp=True)}
    return losses[name](model)


def _selection(full_dev, dev_limit: int | None):
    """The evaluator that selects the weights: ``dev_limit`` pairs of ``full_dev`` evenly spaced over it (STS-B dev is
    ordered by genre), as ``st-prompts train --dev-limit``; ``full_dev`` itself without a limit."""
    if dev_limit is None:
        return full_dev
    if full_dev is None:
        raise ConfigurationError("--dev-limit limits the dev set: give one with --dev, --data-dir or --senteval-dir.")
    from st_prompts.training.pipeline import dev_subset

    return dev_subset(full_dev, dev_limit)


def _whole_dev_score(model, full_dev) -> float:
    """The selected weights' score on the whole dev set, sentences whole as during selection."""
    from st_prompts.modules.lengths import full_length_evaluator

    logger.info(f"Evaluating the selected weights on the whole dev set ({len(full_dev.sentences1):,} pairs).")
    evaluator = full_length_evaluator(full_dev)
    return float(evaluator(model)[evaluator.primary_metric])


def _evaluator(args: argparse.Namespace):
    if args.dev:
        from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator

        from st_prompts.data.task_data import read_task_file

        dev = read_task_file(args.dev)
        if dev.kind != "scored-pairs":
            raise DataFormatError(f"--dev {args.dev} must hold scored pairs (two text columns and a score).")
        d = dev.dataset
        return EmbeddingSimilarityEvaluator(d["sentence1"], d["sentence2"], d["score"], name="dev",
                                            batch_size=128)
    senteval = args.senteval_dir or (os.path.join(args.data_dir, "senteval") if args.data_dir else None)
    if senteval:
        from st_prompts.evaluation import stsb_dev_evaluator

        return stsb_dev_evaluator(senteval, batch_size=128)
    return None
