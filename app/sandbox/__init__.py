"""Agent tasks over small real repositories, and the tools an agent works on them with.

A shared lower layer: the simulator, the gate and the trainer's pretraining corpus use it.

- `tasks.py`: a task is a tiny repository, a module whose one function is a stub to implement
  (its verb says which arithmetic operator) and a test file that fails until it is, plus hidden
  tests.
- `sandbox.py`: `Sandbox` writes a task into a throwaway directory and executes the agent's tool
  calls on it for real: it reads files, applies edits and runs the tests in a subprocess.
- `session.py`: `AgentSession` is one session on a task, turn by turn; `run_sessions` runs
  sessions on a policy in process, as a replica would serve them.

What the hidden tests say about the result (is the function right? were the tests touched?) is the
ground truth the simulated agent users judge by (app/simulate/agents.py) and the gate's agent
checks count (app/controller/monitors.py); the pretraining corpus writes example sessions over
the same tools (trainer/corpus.py `agent_document`), as mid-training does for real agents.

May import: policy
Tests: tests/unit/sandbox/, tests/unit/simulate/test_agents.py
Docs: docs/AGENTS.md
"""
