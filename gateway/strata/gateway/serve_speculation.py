"""`strata serve`'s speculative-decoding options, and their refusals before any stage starts.

The options are the gateway's (strata.gateway.settings: --speculative, --max-draft, --min-draft, --draft-model,
--draft-device, --p-min, --position-cost), spelled for one machine: `--draft PATH` names the draft model. Everything
that can be refused without loading a weight is refused here, before the stages start: options that do not fit
together, draft bounds out of range, and a draft whose vocabulary is not the target's (naming both files), so a bad
draft costs no stage load.
"""

from __future__ import annotations

import argparse

from strata.draft_memory import DRAFT_CACHE_TYPE, draft_memory
from strata.gateway.settings import SPECULATIVE_METHODS, draft_model_refusal
from strata.gateway.speculation import DEFAULTS, Speculation
from strata.gguf.describe import describe
from strata.gguf.header import GGUFHeader


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        choices=[method for method in SPECULATIVE_METHODS if method],
        default="",
        help="speculative decoding: requests without penalties or a grammar send tokens that n-gram lookup over their "
        "context (ngram) or a draft model (draft) proposes, and the stages verify them in one step (default: off)",
    )
    parser.add_argument("--max-draft", type=int, default=DEFAULTS.max_draft, help="tokens a step proposes, at most")
    parser.add_argument("--min-draft", type=int, default=DEFAULTS.min_draft, help="shorter proposals are not sent")
    parser.add_argument(
        "--draft", default="", metavar="PATH", help="--speculative draft's model: a GGUF of the target's vocabulary"
    )
    parser.add_argument(
        "--draft-device", default="cpu", help="where the draft model computes, in the gateway process (default cpu)"
    )
    parser.add_argument(
        "--p-min",
        type=float,
        default=DEFAULTS.p_min,
        help="a draft model's proposal stops before its first pick less likely than this (default %(default)g)",
    )
    parser.add_argument(
        "--position-cost",
        type=float,
        default=DEFAULTS.position_cost,
        help="what one more position adds to a decode step's time, in one-position steps: drafts are as long as pays "
        "by it, and none at all where the batch is full (default %(default)g; bench/speculative.py measures it)",
    )


def refusal(args: argparse.Namespace, *, target: GGUFHeader, target_url: str) -> str | None:
    """Why these options cannot serve `target` (None when they can); reads the draft's header, not its weights."""
    refused = draft_model_refusal(
        speculative=args.speculative, draft_model=args.draft, draft_device=args.draft_device, p_min=args.p_min
    )
    if refused is not None:
        return refused
    if args.speculative:
        try:
            Speculation(
                max_draft=args.max_draft, min_draft=args.min_draft, p_min=args.p_min, position_cost=args.position_cost
            )
        except ValueError as exc:
            return str(exc)
    elif (args.max_draft, args.min_draft, args.position_cost) != (
        DEFAULTS.max_draft,
        DEFAULTS.min_draft,
        DEFAULTS.position_cost,
    ):
        return "draft bounds (max draft, min draft) and a position cost apply to speculative decoding, which is off"
    if args.speculative != "draft":
        return None
    from strata.gateway.draft_model import vocabulary_refusal  # torch and the stage engine, only when drafting
    from strata.gguf import GGUFError, read_model_header

    try:
        draft, _size = read_model_header(args.draft)
    except GGUFError as exc:
        return f"draft model {args.draft}: {exc}"
    return vocabulary_refusal(target=target, draft=draft, target_name=target_url, draft_name=args.draft)


def draft_report(args: argparse.Namespace, *, context: int, slots: int) -> str | None:
    """With method draft, what the draft model will hold in the gateway process (its weights, and its KV of
    `context` cells over `slots` lanes), from its header; None without a draft. Call after `refusal` passed."""
    if args.speculative != "draft":
        return None
    from strata.gguf import read_model_header

    header, size = read_model_header(args.draft)
    held = draft_memory(
        describe(header, file_bytes=size),
        context=context,
        slots=slots,
        cache_type=DRAFT_CACHE_TYPE,
        on_cpu=args.draft_device == "cpu",
    )
    return f"plan: draft model {args.draft} on {args.draft_device}, in the gateway process: {held.describe()}"
