// pg's EventEmitters: the runtime's own where it has one (Node's, with domains and warnings as pg
// expects them), else the `events` package.
module.exports = globalThis.process?.getBuiltinModule?.('events') ?? require('events')
