// First import of the WebSocket driver: pg and pg-protocol need a full Buffer from the moment they
// load. The `buffer` package is evaluated only where the runtime has no Buffer of its own.
import { installBuffer } from '../shims/buffer'

declare const require: (id: 'buffer') => typeof import('buffer')
if (!(globalThis as any).Buffer) installBuffer(require('buffer').Buffer)
