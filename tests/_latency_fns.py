"""Deterministic latency functions ``fn(model: onnx.ModelProto) -> ms`` for search tests.

They are importable by module path, so the CLI can load them with
``--backend tests._latency_fns:NAME`` when run from the repository root.

* :func:`rewards_groups`: a real optimum. A *full group* is a Conv whose activation input and
  weight both come from DequantizeLinear (the activation through a Q -> DQ pair) and whose
  output, directly or through one Relu, feeds a QuantizeLinear.
  ``latency = 10 - 0.5 * full groups + 0.2 * stray activation Q nodes`` (a stray Q belongs to
  no full group).
* :func:`every_qdq_slower`: each Q/DQ node only costs time; the float model is optimal.
* :func:`every_qdq_faster`: each activation Q/DQ pair saves time; quantizing all is optimal.
* :func:`sleepy`: :func:`rewards_groups` after a sleep of ``QDQ_TEST_SLEEP_S`` seconds
  (default 0.2), to make a run slow enough to kill it part way. While the file named by
  ``QDQ_TEST_HOLD_FILE`` exists, a trial's measurement does not return (and
  ``<hold file>.held`` says so), so a test can freeze a run mid-trial.
"""

from __future__ import annotations

import os
import sys
import time

Q, DQ = "QuantizeLinear", "DequantizeLinear"


def _maps(model):
    producer = {}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for out in node.output:
            producer[out] = node
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return producer, consumers


def activation_qs(model) -> list:
    """QuantizeLinear nodes that quantize an activation (not an initializer)."""
    inits = {i.name for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == Q and n.input[0] not in inits]


def full_groups(model) -> tuple[int, set[str]]:
    """Number of full DQ -> Conv -> Q groups and the names of the Q nodes they use."""
    producer, consumers = _maps(model)
    inits = {i.name for i in model.graph.initializer}
    used: set[str] = set()
    groups = 0
    for node in model.graph.node:
        if node.op_type != "Conv" or len(node.input) < 2:
            continue
        x_dq, w_dq = producer.get(node.input[0]), producer.get(node.input[1])
        if x_dq is None or w_dq is None or x_dq.op_type != DQ or w_dq.op_type != DQ:
            continue
        x_q = producer.get(x_dq.input[0])
        if x_q is None or x_q.op_type != Q or x_q.input[0] in inits:
            continue
        tails = [node.output[0]]
        for c in consumers.get(node.output[0], []):
            if c.op_type == "Relu":
                tails.append(c.output[0])
        out_qs = [c for t in tails for c in consumers.get(t, []) if c.op_type == Q]
        if not out_qs:
            continue
        groups += 1
        used.add(x_q.name or x_q.output[0])
        used.update(q.name or q.output[0] for q in out_qs)
    return groups, used


def rewards_groups(model) -> float:
    groups, used = full_groups(model)
    stray = sum(1 for q in activation_qs(model) if (q.name or q.output[0]) not in used)
    return 10.0 - 0.5 * groups + 0.2 * stray


def every_qdq_slower(model) -> float:
    nodes = sum(1 for n in model.graph.node if n.op_type in (Q, DQ))
    return 10.0 + 0.5 * nodes


def every_qdq_faster(model) -> float:
    """Each activation Q/DQ pair saves time: the model with every offered pair is fastest (a
    search commits everything it can, accurate or not)."""
    return 10.0 - 0.1 * len(activation_qs(model))


def sleepy(model) -> float:
    time.sleep(float(os.environ.get("QDQ_TEST_SLEEP_S", "0.2")))
    _hold_in_a_trial()
    return rewards_groups(model)


def _hold_in_a_trial() -> None:
    """While ``QDQ_TEST_HOLD_FILE`` exists, a measurement made for a trial (not for a reference
    or a commit) does not return, and ``<hold file>.held`` holds its pid: a test then knows
    the process is frozen inside a trial's objective."""
    hold = os.environ.get("QDQ_TEST_HOLD_FILE")
    if hold and os.path.exists(hold) and _in_trial():
        with open(hold + ".held", "w") as fh:
            fh.write(str(os.getpid()))
        while os.path.exists(hold):
            time.sleep(0.02)


def sleepy_costmodel(model) -> float:
    """The ``costmodel`` backend's latency of ``model`` after a sleep of ``QDQ_TEST_SLEEP_S``
    seconds (default 0.25): deterministic figures at a pace several workers can share; held
    like :func:`sleepy`."""
    from qdq_optuna.backends.costmodel import CostModelBackend

    time.sleep(float(os.environ.get("QDQ_TEST_SLEEP_S", "0.25")))
    _hold_in_a_trial()
    return CostModelBackend().estimate(model).total_ms


def _in_trial() -> bool:
    """Whether the caller is a search trial's objective (and not a reference measurement)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "objective" and frame.f_code.co_filename.endswith("_pattern.py"):
            return True
        frame = frame.f_back
    return False


_CALLS = [0]


def costmodel_interruptible(model) -> float:
    """The ``costmodel`` backend's latency of ``model``. With ``$QDQ_TEST_INTERRUPT_AT=N`` the
    Nth call of the process raises KeyboardInterrupt, as a Ctrl-C there would (to cut a run at
    a known point, deterministically)."""
    from qdq_optuna.backends.costmodel import CostModelBackend

    _CALLS[0] += 1
    if _CALLS[0] == int(os.environ.get("QDQ_TEST_INTERRUPT_AT", "0")):
        raise KeyboardInterrupt
    return CostModelBackend().estimate(model).total_ms


def preprocessing_slows(model) -> float:
    """The user's file (it still has BatchNormalization nodes, which ONNX Runtime's basic
    preprocessing folds into the Convs) runs fastest: every model the search can make is
    slower, whatever its Q/DQ."""
    if any(n.op_type == "BatchNormalization" for n in model.graph.node):
        return 5.0
    return 10.0 - 0.1 * len(activation_qs(model))


def only_everything_quantized_is_fast(model) -> float:
    """Float 10 ms; every activation Q/DQ costs 0.1 ms unless the model has at least
    :data:`WHOLE` of them, when its integer kernels run end to end in 5 ms: a start with
    every point on is fast, any part of it (a repaired start) slower than float."""
    qs = len(activation_qs(model))
    return 5.0 if qs >= WHOLE else 10.0 + 0.1 * qs


#: activation Q/DQ pairs from which :func:`only_everything_quantized_is_fast` runs fast (the
#: heavy-tail model of ``corpus.heavy_tail`` has 10 with every point on)
WHOLE = 10


def few_groups_pay(model) -> float:
    """Float 10 ms; each full DQ -> Conv -> Q group saves 0.5 ms while the model has at most
    :data:`FEW` of them; with more, its integer part spills (5 ms more): every quantized start
    of :func:`corpus.conv_chain` runs slower than float, its groups added one by one pay."""
    groups, _ = full_groups(model)
    return 10.0 - 0.5 * groups + (5.0 if groups > FEW else 0.0)


#: full groups up to which :func:`few_groups_pay` rewards each
FEW = 3
