/**
 * First uses that cost milliseconds each (V8 compiling a long pattern on its first match, WebCrypto's
 * first keys), made before the proxy listens rather than inside the first session's login.
 */
import { webcrypto } from 'node:crypto'
import { isLoopback, limitKey } from './listen/client-address'
import { loadReader } from './isolation/reader'

export async function warmUp(): Promise<void> {
  await loadReader()
  for (const address of ['127.0.0.1', '::ffff:127.0.0.1', '::ffff:7f00:1', '2001:db8::1']) limitKey(address), isLoopback(address)
  // What SCRAM with Postgres runs (pg's client, on WebCrypto), at one iteration.
  const { subtle } = webcrypto
  const bytes = new Uint8Array(32)
  const pbkdf2 = await subtle.importKey('raw', bytes, 'PBKDF2', false, ['deriveBits'])
  await subtle.deriveBits({ name: 'PBKDF2', hash: 'SHA-256', salt: bytes, iterations: 1 }, pbkdf2, 256)
  const hmac = await subtle.importKey('raw', bytes, { name: 'HMAC', hash: 'SHA-256' }, false, ['sign'])
  await subtle.sign('HMAC', hmac, bytes)
  await subtle.digest('SHA-256', bytes)
}
