"""The data model: what an episode is (``EpisodeSpec``, ``Limits``, ``Sandbox``), what came of
it (``EpisodeOutcome``, ``SandboxReport``) and the exception tree. Nothing here touches the
system."""
