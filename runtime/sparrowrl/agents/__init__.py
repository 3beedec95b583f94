"""Multi-turn episodes (task.environment): a user's environment loaded and checked
(`environment`), its turns as tokens the same on the worker and the trainer (`turns`), and the
episode a worker ran read back into the messages its rubric scores (`transcript`).

Workers run the episodes (worker/episodes.py); the trainer scores them (trainer/scoring.py)."""
