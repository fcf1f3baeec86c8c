"""The coordinator's control code, a room for each thing it holds.

roster: the connected agents and what each holds; routes: which models are ready and the hops through them;
plans: which agent serves which layers of each model (models: their checked config); drains: the stages moving
off an agent being drained, and drainer: the task that drives a drain to its end; events: what the control
code and the origin tell each other; deployer: the Deployer, which composes the rooms; servicer: the gRPC
ControlService, the only module here that converts to and from protobuf."""
