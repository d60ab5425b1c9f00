/**
 * A session speaking raw protocol over the proxy's WebSocket, logged in inside the upgrade as an
 * edgepg Client is (with the subprotocols such a Client offers: offeredLogin), so that it shares
 * that Client's pool key. For tests that send frontend messages no client library would.
 */
import assert from 'node:assert/strict'
import { WebSocket } from 'ws'
import type { Client, ClientConfig } from '../../src/index'
import { LOGIN_PREFIX } from '../../src/config'
import { within } from './helpers'
import { backendReader, queryMessage, TERMINATE } from './protocol'

type Message = { type: string; body: Buffer }

/** The subprotocols (the login in the upgrade among them) a Client made by `connect` offers. */
export async function offeredLogin(connect: (extra: ClientConfig) => Promise<Client>): Promise<string[]> {
  let offered: string[] = []
  class Recording extends WebSocket {
    constructor(url: string, protocols?: string | string[], ...rest: any[]) {
      super(url, protocols, ...rest)
      offered = ([] as string[]).concat(protocols ?? [])
    }
  }
  await (await connect({ webSocketConstructor: Recording as any })).end()
  assert.ok(offered.some((p) => p.startsWith(LOGIN_PREFIX)), `the Client offers its login in the upgrade: ${offered}`)
  return offered
}

export class RawSession {
  private messages: Message[] = []
  private wake: (() => void) | undefined
  private closed = false

  private constructor(private ws: WebSocket) {
    const read = backendReader((type, body) => {
      this.messages.push({ type, body: Buffer.from(body) })
      this.wake?.()
    })
    ws.on('message', (data, binary) => binary && read(data as Buffer)) // (text frames are the proxy's own: seen positions)
    ws.on('close', () => {
      this.closed = true
      this.wake?.()
    })
    ws.on('error', () => {})
  }

  static async open(port: number, protocols: string[]): Promise<RawSession> {
    const ws = new WebSocket(`ws://127.0.0.1:${port}/v2`, protocols)
    const s = new RawSession(ws)
    await new Promise((resolve, reject) => ws.once('open', resolve).once('error', reject))
    const refused = (await s.untilReady()).find((m) => m.type === 'E')
    if (refused) throw new Error(`raw login refused: ${errorCode(refused.body)}`)
    return s
  }

  /** Messages up to and including the next ReadyForQuery. */
  private async untilReady(): Promise<Message[]> {
    for (;;) {
      const z = this.messages.findIndex((m) => m.type === 'Z')
      if (z >= 0) return this.messages.splice(0, z + 1)
      if (this.closed) throw new Error('raw session closed')
      await new Promise<void>((resolve) => (this.wake = resolve))
    }
  }

  /** Sends `bytes`; the first ErrorResponse's code, else 'ok'; and the first column of the first row. */
  async run(bytes: Buffer): Promise<{ outcome: string; first?: string }> {
    this.ws.send(bytes)
    const answer = await this.untilReady()
    const error = answer.find((m) => m.type === 'E')
    const row = answer.find((m) => m.type === 'D')?.body
    return { outcome: error ? errorCode(error.body) : 'ok', first: row && row.readInt32BE(2) >= 0 ? row.toString('utf8', 6, 6 + row.readInt32BE(2)) : undefined }
  }

  /** Sends `bytes` as one WebSocket message, without waiting for an answer. */
  send(bytes: Buffer) {
    this.ws.send(bytes)
  }

  /** What Postgres answered up to and including the next `n` ReadyForQuery messages. */
  async readies(n: number): Promise<Message[]> {
    const answer: Message[] = []
    for (let i = 0; i < n; i++) answer.push(...(await this.untilReady()))
    return answer
  }

  async pid(): Promise<number> {
    const { first } = await this.run(queryMessage('SELECT pg_backend_pid()'))
    if (first === undefined) throw new Error('raw session: no pid')
    return Number(first)
  }

  async end() {
    if (this.closed) return
    const closed = new Promise((resolve) => this.ws.once('close', resolve))
    this.ws.send(TERMINATE)
    this.ws.close()
    await within(5000, 'the raw session to close', closed)
  }
}

/** An ErrorResponse's SQLSTATE. */
export function errorCode(body: Buffer): string {
  for (let i = 0; i < body.length && body[i] !== 0; ) {
    const end = body.indexOf(0, i + 1)
    if (body[i] === 0x43 /* C */) return body.toString('utf8', i + 1, end)
    i = end + 1
  }
  return 'error'
}
