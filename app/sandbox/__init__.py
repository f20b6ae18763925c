"""Agent tasks over small real repositories, and the tools an agent works on them with.

A task (`tasks.py`) is a tiny repository: a module whose one function has a bug (the wrong
arithmetic operator) and a test file that shows it. `Sandbox` (`sandbox.py`) writes a task into a
throwaway directory and executes the agent's tool calls on it for real: it reads files, applies
edits and runs the tests in a subprocess. What the task's hidden tests say about the result (is the
bug fixed? were the tests touched?) is the ground truth the simulated agent users judge by
(app/simulate/agents.py); the pretraining corpus writes example sessions over the same tools
(trainer/corpus.py `agent_documents`), as mid-training does for real agents.

May import: nothing of the project (a shared lower layer: the simulator and the trainer use it)
Tests: tests/unit/sandbox/
Docs: docs/AGENTS.md "Agent users"
"""
