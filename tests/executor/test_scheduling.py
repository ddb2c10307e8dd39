"""Planning is pure: memory accounting and preemption order without running a model."""

from rose.services.executor.scheduling import Limits, SeqView, plan_iteration, plan_shrink

LIMITS = Limits(max_batch=4, prefill_tokens=32, block_size=16)


def test_serving_reserves_full_length_and_admits_fcfs():
    waiting = [SeqView(1, 20, 0, 0, 20 + 44), SeqView(2, 10, 0, 0, 10 + 6)]
    plan = plan_iteration([], waiting, free_blocks=4, evictable_blocks=0, limits=LIMITS)
    assert plan.admit == (1,) and plan.new_blocks == {1: 4}  # 64 tokens reserved; #2 does not overtake
    assert plan.prefill == ((1, 20),)


def test_growth_evicts_cache_before_preempting():
    one = [SeqView(1, 33, 32, 2, 33)]
    plan = plan_iteration(one, [], free_blocks=0, evictable_blocks=1, limits=LIMITS)
    assert plan.evict_cached_blocks == 1 and plan.preempt == ()  # the retained prefix goes first
    two = [SeqView(1, 33, 32, 2, 33), SeqView(2, 33, 32, 2, 33)]
    plan = plan_iteration(two, [], free_blocks=0, evictable_blocks=1, limits=LIMITS)
    assert plan.preempt == (2,)  # not enough even with the cache: the youngest is preempted
    assert plan.evict_cached_blocks == 0  # its freed blocks cover the oldest's growth
    assert plan.decode == (1,) and plan.new_blocks == {1: 1}


def test_shrink_evicts_lru_entries_then_preempts_youngest():
    entries, victims = plan_shrink(5, [2, 2], [(1, 3), (2, 3)])
    assert entries == 2 and victims == (2,)
    entries, victims = plan_shrink(3, [2, 2, 2], [(1, 3)])
    assert entries == 2 and victims == ()
