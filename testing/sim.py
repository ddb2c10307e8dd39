"""Inputs for the simulator's tests."""

# A made-up `rose bench e2e` result in that command's layout (bench/e2e.py): test data, not a measurement.
SYNTHETIC_E2E = {
    "serving_executors": 2,
    "dedicated_executors": 1,
    "fleet": {
        "slo_ttft_ms": 500,
        "slo_tpot_ms": 100,
        "base_rps": 3.0,
        "burst_factor": 3.0,
        "burst_every_s": 15,
        "burst_len_s": 3,
        "serving_max_tokens": 32,
        "rollout_max_tokens": 16,
        "worker_concurrency": 32,
    },
    "calibration": {
        "step_times": {
            "serving": {
                "measured_steps": {"decode_base_s": 0.002, "decode_per_seq_s": 0.0005, "prefill_base_s": 0.002, "prefill_per_token_s": 0.0001}
            },
            "policy": {
                "measured_steps": {"decode_base_s": 0.004, "decode_per_seq_s": 0.0004, "prefill_base_s": 0.003, "prefill_per_token_s": 0.0002}
            },
        }
    },
    "policies": {
        name: {
            "rl_steps_per_hour": 300.0,
            "rollout_s_per_step": 8.0,
            "serving_slo_attainment": 0.99,
            "rollout_tokens_per_s": 100.0,
            "calibration": {
                "trajectories_per_step": 16,
                "turns_per_trajectory": 2.5,
                "tokens_per_turn": 12,
                "prompt_tokens_per_turn": 80,
                "train_s_per_step": 3.0,
                "publish_s_per_step": 0.5,
                "serving_arrival_rps_per_executor": 3.0,
            },
        }
        for name in ("static", "naive_share", "elastic_baseline", "rose")
    },
}
