"""The contracts every process shares: what crosses a process boundary, each in one module."""
