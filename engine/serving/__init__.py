"""The serving core: requests, their intake, the scheduler, the step plan, the runner, the loop
thread, sampling, detokenizing and the result types. It never imports engine.engine."""
