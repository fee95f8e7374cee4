"""Step 1 of a held two-step request runs as soon as a prefill server has its share free.

A two-step request that no decode server fits computes its prompt while it waits
(``disaggregated.prefill_while_holding``), within a share of each prefill server's KV
(``disaggregation.early_prefill_fraction``, ``proxy.core.early_prefill``). Three rules make
that pay on a fleet whose decode servers stay full (measured at a larger scale, below):

* **While any request is held, a long two-step request reserves no decode room before its
  prompt is computed** (``prefill_pending``, read by ``held_room.nodes_kept``), and takes
  no place in the line of held requests until then. It used to reserve its decode room
  first whenever every prefill server held its share, then wait for step 1 there: that
  room stayed empty through the prefill server's queue and the prefill itself. Now it
  waits at the gateway, and every look of its hold asks again (``prefill_due``): once a
  share frees, step 1 runs, and the request then takes the first decode room that frees.
* **Shares go in arrival order** (``EarlyPrefills.turn``): a request that found none free
  waits in line for one, and a newer one does not take the next before it.
* **A share is taken when step 1 is decided, before any await** (``claim_share``), on the
  open server holding least, and moved to the server step 1 lands on. Counted only when
  step 1 answered, one report woke 68 held requests at once; each saw the same share free
  and all sent step 1 to the same server. Its KV filled with prompts nobody pulled, and
  the step 1s of requests already placed on a decode server queued behind them while their
  decode rooms stood empty: a wait of each for the other that only the prefill server's
  pull timeout broke (38-131 of 843 requests failed after 120 s).

Measured (2 prefill + 2 decode servers of 120,000 tokens, 15-30k-token documents at 20
requests/s, ``python -m loadtest.bench pd``): docs/results.md, "Does disaggregated prefill
and decode place decode by fit?".
"""

from __future__ import annotations

from proxy.core.two_step import TwoStep, worth_two_steps
from proxy.gateway.context import RequestContext
from proxy.gateway.early_prefills import EarlyPrefillBook


def prefill_pending(ctx: RequestContext) -> bool:
    """A two-step request whose step 1 is still to run, worth running before its decode
    placement (vLLM's protocol, a prompt long enough, early prefills allowed)."""
    two = ctx.two_step
    cfg = ctx.cfg.disaggregation
    if two is None or two.step == "decode":
        return False
    if cfg.protocol == "sglang" or cfg.early_prefill_fraction <= 0:
        # SGLang's prefill server computes only once the decode server joined the room.
        return False
    return worth_two_steps(ctx.prompt_tokens, cached_at_decode(two), cfg.min_uncached_prompt_tokens)


def cached_at_decode(two: TwoStep) -> int:
    """The most prompt tokens a decode-capable server probably caches already."""
    return max((v for n, v in two.cached.items() if n not in two.prefill_only), default=0)


def prefill_servers(ctx: RequestContext, two: TwoStep) -> frozenset[str]:
    """The servers step 1 may run on."""
    return frozenset(b.name for b in ctx.cfg.backends) - two.decode_only - two.ruled_out


def full_servers(book: EarlyPrefillBook, ctx: RequestContext, two: TwoStep) -> frozenset[str]:
    """Prefill servers without their share free for this prompt (or left out for it)."""
    servers = prefill_servers(ctx, two)
    fraction = ctx.cfg.disaggregation.early_prefill_fraction
    return book.full(servers, ctx.snap, ctx.prompt_tokens, fraction) | two.prefill_exclude


def prefill_due(book: EarlyPrefillBook, ctx: RequestContext) -> bool:
    """A held request whose step 1 is pending, its turn for a share come, and some prefill
    server with its share free."""
    two = ctx.two_step
    if two is None or not prefill_pending(ctx) or not book.holds.turn(ctx.reservation_id):
        return False
    return not prefill_servers(ctx, two) <= full_servers(book, ctx, two)


def claim_share(book: EarlyPrefillBook, ctx: RequestContext, two: TwoStep) -> frozenset[str] | None:
    """Take this prompt's share on the open server holding least; the servers step 1 must
    leave out (None: every one is full, or an older held request waits for a share: it
    joins their line). ``disaggregated._prefill`` moves the share to the server step 1 lands
    on; the request's end releases it (and its place in the line)."""
    full = full_servers(book, ctx, two)
    open_ = prefill_servers(ctx, two) - full
    if not open_ or not book.holds.turn(ctx.reservation_id):
        book.holds.wait(ctx.reservation_id)
        return None
    first = min(open_, key=lambda n: (book.holds.tokens(n), n))
    book.add(first, ctx.reservation_id, ctx.prompt_tokens)
    return full
