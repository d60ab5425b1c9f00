// First import of the WebSocket driver: pg and pg-protocol need a full Buffer from the moment they
// load. (The `buffer` package is used only where the runtime has no Buffer of its own.)
import { Buffer } from 'buffer'
import { installBuffer } from '../shims/buffer'

installBuffer(Buffer)
