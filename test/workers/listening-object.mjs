// A Durable Object holding a listening session, run by test/durable-object.test.ts in workerd via
// miniflare: a Worker's way to keep one connection open across requests. POST /listen?channel=c
// opens the Client (by token) and LISTENs; GET /heard lists the notifications it has heard since;
// POST /end ends the Client. Bindings: TOKEN_PROXY_PORT, DATABASE_URL (where, no password), TOKEN.
import { Client } from '../../dist/index.mjs'

export class Listening {
  constructor(state, env) {
    this.env = env
    this.heard = []
  }

  async fetch(request) {
    const url = new URL(request.url)
    try {
      if (url.pathname === '/listen') {
        if (!this.client) {
          const { hostname: host, port, pathname } = new URL(this.env.DATABASE_URL)
          this.client = new Client({ host, port: Number(port), database: pathname.slice(1), authToken: () => this.env.TOKEN, wsProxy: () => `ws://127.0.0.1:${this.env.TOKEN_PROXY_PORT}/v2` })
          this.client.on('notification', ({ channel, payload }) => this.heard.push({ channel, payload }))
          await this.client.connect()
        }
        await this.client.query(`LISTEN "${url.searchParams.get('channel')}"`)
        return Response.json({ listening: true })
      }
      if (url.pathname === '/heard') return Response.json(this.heard)
      if (url.pathname === '/end') {
        await this.client?.end()
        this.client = undefined
        return Response.json({ ended: true })
      }
      return new Response('not found', { status: 404 })
    } catch (err) {
      return Response.json({ error: err.message, code: err.code }, { status: 500 })
    }
  }
}

export default {
  fetch(request, env) {
    return env.LISTENING.get(env.LISTENING.idFromName('one')).fetch(request)
  },
}
