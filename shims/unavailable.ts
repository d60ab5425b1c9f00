// Stand-in for Node built-ins that pg only reaches on paths edgepg never takes in the bundle
// (Unix sockets, TCP, DNS lookups, ssl key files). Anything that does reach it gets a clear error.
function unavailable(): never {
  throw new Error('edgepg: this Node.js API is not available in the edgepg bundle')
}
export const lookup = unavailable
export const connect = unavailable
export const readFileSync = unavailable
export const createHash = unavailable
export const join = (...parts: string[]) => parts.join('/')
export const resolve = join
export class Stream {}
export class StringDecoder {}
export default { lookup, connect, readFileSync, createHash, join, resolve, Stream, StringDecoder }
