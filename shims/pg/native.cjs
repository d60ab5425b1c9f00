// Stands in for pg/lib/native (libpq bindings, Node-only), as if pg-native were not installed:
// pg then reports `pg.native` as null, as it does in Node without it.
const err = new Error('edgepg: pg.native (libpq) is not available; edgepg connects over WebSockets')
err.code = 'MODULE_NOT_FOUND'
throw err
