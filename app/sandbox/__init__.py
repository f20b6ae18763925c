"""Agent tasks over small real repositories, and the tools an agent works on them with.

A task (`tasks.py`) is a tiny repository: a module whose one function has a bug (the wrong
arithmetic operator) and a test file that shows it. `Sandbox` (`sandbox.py`) writes a task into a
throwaway directory and executes the agent's tool calls on it for real: it reads files, applies
edits and runs the tests in a subprocess. `AgentSession` (`session.py`) is one session on a task,
turn by turn, and `run_sessions` runs sessions on a policy in process, as a replica would serve them. What the task's hidden tests say about the result (is the
bug fixed? were the tests touched?) is the ground truth the simulated agent users judge by
(app/simulate/agents.py); the pretraining corpus writes example sessions over the same tools
(trainer/corpus.py `agent_documents`), as mid-training does for real agents.

May import: policy (a shared lower layer: the simulator, the gate and the trainer use it)
Tests: tests/unit/sandbox/
Docs: docs/AGENTS.md "Agent users"
"""
