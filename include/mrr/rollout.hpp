// Rollout-side pieces an RL trainer needs: seeded sampling (temperature, top-k, top-p) with
// per-token log-probabilities and their gradient (verl's logprobs_from_logits).
#pragma once

#include <mrr/rollout/sampling.hpp>
