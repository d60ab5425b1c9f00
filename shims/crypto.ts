import { md5 } from '@noble/hashes/legacy.js'
import { Buffer } from 'buffer'

// pg hashes md5 passwords with createHash('md5') (WebCrypto has no MD5) and does everything else,
// SCRAM included, with WebCrypto, which it finds here or on globalThis.
export const webcrypto = globalThis.crypto

export function createHash(algorithm: string) {
  if (algorithm !== 'md5') throw new Error(`edgepg: createHash('${algorithm}') is not available; pg only needs md5`)
  const parts: Uint8Array[] = []
  const hash = {
    update(data: string | Uint8Array, encoding?: string) {
      parts.push(typeof data === 'string' ? Buffer.from(data, encoding as BufferEncoding) : data)
      return hash
    },
    digest(encoding?: BufferEncoding) {
      const out = Buffer.from(md5(Buffer.concat(parts)))
      return encoding ? out.toString(encoding) : out
    },
  }
  return hash
}
export default { webcrypto, createHash }
