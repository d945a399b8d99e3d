package pp

// RunOn is runOn for the external tests: ranks of comm/local or comm/tcp.
var RunOn = runOn
