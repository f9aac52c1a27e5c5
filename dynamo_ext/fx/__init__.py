"""Reading FX graphs: node values (:mod:`.nodes`), the ops of a run of nodes (:mod:`.ops`) and the collectives a graph issues (:mod:`.collectives`).

One answer per question for every module that reads compiled graphs: the
Inductor passes, the collective check and the audit.
"""
