"""Plan/Act environment: a trained planner writes a numbered plan, a frozen actor executes it.

``tasks`` (reasoning-gym problems and scorer, ``make_tasks``) and ``episode``
(the planner's timed turn, the actor's steps, the fallback when the planner does
not answer). Knobs: ``env.plan_act`` in the config. The worker entry points are
in ``workers.plan_act``; the recipe is ``configs/plan_act.yaml``.
"""
