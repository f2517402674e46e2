// Umbrella header of the PPO/GRPO utilities (mrr::ppo): advantage estimators and their registry,
// KL penalties and controllers, loss aggregation, policy/value/entropy losses with gradients,
// masked statistics, rollout importance weights, multi-turn state masks and rule-based rewards.
#pragma once

#include <mrr/ppo/advantage.hpp>
#include <mrr/ppo/aggregate.hpp>
#include <mrr/ppo/groups.hpp>
#include <mrr/ppo/grpo_step.hpp>
#include <mrr/ppo/kl.hpp>
#include <mrr/ppo/masked.hpp>
#include <mrr/ppo/optional_view.hpp>
#include <mrr/ppo/policy_loss.hpp>
#include <mrr/ppo/registry.hpp>
#include <mrr/ppo/reward_rules.hpp>
#include <mrr/ppo/rollout_correction.hpp>
#include <mrr/ppo/rollout_rejection.hpp>
#include <mrr/ppo/state_mask.hpp>
#include <mrr/ppo/value_loss.hpp>
