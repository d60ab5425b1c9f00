/**
 * A token's claims, handed to Postgres so that the session cannot change them (see `edgepg
 * setup-auth`, proxy/auth/setup.ts). Each backend gets a random key of its own when the proxy first
 * uses it for tokens (edgepg.init, once: Postgres refuses it again for that backend). Before each
 * session or lend the proxy calls edgepg.set_claims(n, claims, mac), where n counts up per backend
 * and mac = HMAC-SHA256(key, "n:claims"): the function checks both, so a call made up or replayed
 * by a client fails, and stores the claims where only edgepg.claims() reads them. The key and MAC
 * travel as bind parameters: no query text, pg_stat_activity included, shows them.
 *
 * Claims are set before anything of the session's runs on the backend, and the session waits for
 * Postgres's answer: a backend whose claims could not be set serves no one.
 */
import { createHmac, randomBytes } from 'node:crypto'
import { serialize } from 'pg-protocol'
import type { Upstream } from '../upstream/connection'
import { exchange } from '../upstream/exchange'

/** What the proxy knows of a backend it set claims on: its key, and the last n it used. */
interface Keyed {
  key: Buffer
  n: number
}
const keyed = new WeakMap<Upstream, Keyed>()

const INIT = 'SELECT edgepg.init($1)'
const SET = 'SELECT edgepg.set_claims($1, $2, $3)'
const SYNC = serialize.sync()
const EXECUTE = serialize.execute({})

export class ClaimsError extends Error {
  constructor(message: string, readonly code: string) {
    super(message)
  }
}

const hex = (b: Buffer) => `\\x${b.toString('hex')}`

function statement(text: string, values: string[]): Buffer {
  return Buffer.concat([serialize.parse({ text }), serialize.bind({ values }), EXECUTE])
}

/**
 * The messages that set `claims` (JSON text) on the backend behind `upstream`: edgepg.init first if
 * it has no key yet. One Sync group; the unnamed statement
 * is closed after, as a fresh session finds none.
 */
export function claimsMessages(upstream: Upstream, claims: string): Buffer {
  let k = keyed.get(upstream)
  const parts: Buffer[] = []
  if (!k) {
    keyed.set(upstream, (k = { key: randomBytes(32), n: 0 }))
    parts.push(statement(INIT, [hex(k.key)]))
  }
  const n = String(++k.n)
  const mac = createHmac('sha256', k.key).update(`${n}:${claims}`).digest()
  parts.push(statement(SET, [n, claims, hex(mac)]), serialize.close({ type: 'S', name: '' }), SYNC)
  return Buffer.concat(parts)
}

/** Sends the proxy's own messages and resolves with Postgres's error, if it gave one (rejects if the connection broke). */
export type Send = (bytes: Buffer) => Promise<{ code: string; message: string } | undefined>

const exchanged = (upstream: Upstream): Send => async (bytes) => {
  const answer = await exchange(upstream, bytes)
  if (!answer) throw new ClaimsError("edgepg-proxy: the connection to Postgres closed while the session's claims were set", '08006')
  return answer.error
}

/** Sets `claims` on an idle backend (by `send`: an exchange of its own by default) and waits for Postgres to confirm; ClaimsError says why not. */
export async function setClaims(upstream: Upstream, claims: string, send: Send = exchanged(upstream)): Promise<void> {
  const error = await send(claimsMessages(upstream, claims)).catch((err) => {
    keyed.delete(upstream)
    throw err
  })
  if (!error) return
  keyed.delete(upstream) // (it serves no one now: the caller closes it)
  const missing = (error.code === '42883' || error.code === '3F000') && error.message.includes('edgepg')
  throw new ClaimsError(
    missing
      ? `edgepg-proxy: the database has no edgepg functions for tokens: run edgepg-proxy setup-auth <database-url> (Postgres said: ${error.message})`
      : `edgepg-proxy: the session's claims could not be set: ${error.message}`,
    missing ? '28000' : error.code
  )
}
