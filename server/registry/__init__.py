"""The task registry: which tasks exist and whether they can be served (tasks), per-request mixes
of tasks (mixes), search by routing row (similar_index), who may see and change a task
(ownership), and the domain errors the HTTP layer maps to statuses (errors)."""
