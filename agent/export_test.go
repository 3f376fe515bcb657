package agent

// NewInformers lets the external tests build exactly the agent's informers
// (BenchmarkIntegrationAgentInformersAtScale runs them alone in a process
// of their own).
var NewInformers = newInformers

// NamespacesResource is the resource the namespace informer watches.
var NamespacesResource = namespacesResource

// LoadRestConfig is how the agent builds its client configuration.
var LoadRestConfig = loadRestConfig
