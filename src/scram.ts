// pg's SCRAM client, in a file of its own: the bundle loads it on first use (shims/pg/sasl.ts).
import sasl from 'pg/lib/crypto/sasl.js'
export default sasl
