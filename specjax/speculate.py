"""One speculative step: draft, verify, commit, count.

Shape letters (`specjax.shapes`): B batch, G = γ draft tokens per step (γ_max
under an adaptive policy; a token tree's T nodes at depth at most γ), V
vocab, N max new tokens.

`speculate_step` is a pure function of `SpecState` (`specjax.step_types`);
the loops (`specjax.loops`) run it in a `lax.while_loop`. It is five
stages, each reusable on its own:

1. the γ policy sets each row's draft budget (`StepPolicy.budget`, the
   step's part of `specjax.policies.GammaPolicy`; a fixed γ is the policy
   `Fixed`);
2. the drafter proposes up to that budget (`Drafter.propose`), only when
   some row may draft (`propose_if`), and the policy keeps the drafts worth
   verifying (`StepPolicy.trim`): the one place a proposal is capped;
3. the target scores the last committed token and the drafts in one
   static-shape pass over the smallest compiled width that holds them and
   rejection-samples them (`specjax.verify.verify_within`);
4. the drafter and the output buffer commit what was emitted
   (`Drafter.commit`, `buffers.emit`), and the policy learns from it
   (`StepPolicy.update`);
5. `SpecStats.update` counts.

Rows accept different counts; each row's target and draft caches roll back
to their own lengths. Rows that are done are carried along unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import buffers
from specjax.drafters.base import Drafter
from specjax.drafters.base import propose_if
from specjax.models.protocol import LanguageModel
from specjax.step_types import Proposal
from specjax.step_types import SpecState
from specjax.step_types import SpecStats
from specjax.step_types import StepParams
from specjax.step_types import StepPolicy
from specjax.step_types import Verification
from specjax.verify import verify_within

__all__ = ["Proposal", "SpecState", "SpecStats", "StepParams",
           "Verification", "speculate_step"]


def speculate_step(state: SpecState, *, target: LanguageModel,
                   drafter: Drafter, params: StepParams, policy: StepPolicy,
                   max_new_tokens: int | jax.Array,
                   num_nodes: int | None = None,
                   budget: jax.Array | None = None) -> SpecState:
  """Drafts up to G tokens, verifies them in one target pass, and commits.

  Args:
    state: loop state.
    target: a `specjax.models.LanguageModel`.
    drafter: a `specjax.drafters.Drafter`.
    params: traced settings.
    policy: a `StepPolicy`, e.g. a `specjax.policies.GammaPolicy` (G is
      its `max_gamma`; a fixed γ is `policies.Fixed(γ)`).
    max_new_tokens: N, an int or a traced [] int32.
    num_nodes: None for a chain; T for a token tree of at most T nodes at
      depth at most G (`specjax.tree`, under `Fixed(G, num_nodes=T)`).
    budget: [B] int32 the policy's budget for this state, where the caller
      already asked it (`policy.budget`); None to ask here.

  Returns:
    The next state.
  """
  key, draft_key, verify_key = jax.random.split(state.key, 3)
  active = state.active
  # The controls' history through the last committed token.
  sampling = params.sampling.replace(controls=state.controls)
  remaining = max_new_tokens - state.num_generated  # [B]
  if budget is None:
    budget = policy.budget(state.policy_state, active, remaining)  # [B]
  tree_kw = {} if num_nodes is None else {"num_nodes": num_nodes}
  propose = lambda s: drafter.propose(
      s, draft_key, sampling, policy.max_gamma, params.stop_threshold,
      limit=budget, **tree_kw)
  if len(policy.widths) == 1:  # one width: every step drafts
    proposal, drafter_state = propose(state.drafter_state)
  else:
    proposal, drafter_state = propose_if(jnp.any(budget > 0), propose,
                                         state.drafter_state, drafter)
  drafted = jnp.minimum(proposal.num_drafted, budget)  # [B]
  proposal = proposal.replace(num_drafted=jnp.minimum(
      drafted, policy.trim(state.policy_state, drafted, active, remaining)))
  start = state.target_cache.lengths
  verification, target_cache, scored = verify_within(
      policy.widths, target, state.target_cache, state.last_token, proposal,
      sampling, verify_key, acceptance=params.acceptance)

  num_accepted = jnp.where(active, verification.num_accepted, 0)
  verification = verification.replace(num_accepted=num_accepted)
  target_cache = target_cache.rollback(
      jnp.where(active, target_cache.lengths, start))
  drafter_state = drafter.commit(drafter_state, proposal, verification,
                                 active)
  tokens, num_generated, done, stop_state = buffers.emit(
      state.tokens, state.num_generated, state.done, verification.emitted,
      verification.num_emitted, params.eos_ids, max_new_tokens,
      params.stops, state.stop_state)
  controls = state.controls
  if controls is not None:
    controls = controls.advance_many(verification.emitted,
                                     num_generated - state.num_generated)
  return state.replace(
      tokens=tokens, num_generated=num_generated, done=done,
      controls=controls, stop_state=stop_state,
      last_token=jnp.where(active, verification.next_token,
                           state.last_token),
      target_cache=target_cache, drafter_state=drafter_state, key=key,
      stats=state.stats.update(proposal, num_accepted, active, scored,
                               verification.experts),
      policy_state=policy.update(state.policy_state, budget, proposal,
                                 num_accepted, active))
