import gc

from agent.heap import settle_after_start_up


def test_start_up_objects_leave_the_collected_generations() -> None:
    start_up = [[i] for i in range(1000)]  # containers: tracked by the collector
    try:
        frozen = settle_after_start_up()
        collected = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
        assert frozen >= len(start_up)
        assert not any(id(o) in collected for o in start_up)
        made_later = [0]
        assert id(made_later) in {id(o) for o in gc.get_objects(0)}  # serving objects are still collected
    finally:
        gc.unfreeze()  # the test process must not keep a frozen heap for the tests after this one
